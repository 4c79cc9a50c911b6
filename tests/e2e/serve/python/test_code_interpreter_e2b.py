"""`e2b_code_interpreter` behaving like E2B's own code interpreter (issue #12), through
`cubicle serve` on `code-interpreter-v1`: default Python and JavaScript contexts in
creation order, the sandbox's env vars in every language (restored after a per-run
override), kernels as root (any `cwd`), PIL/`savefig` images, every chart type of
`e2b-charts`, R and Java kernels, the access-token check on `/execute`, and a create
served by a warm pool (when the server runs one: `CUBICLE_E2E_SERVE_ARGS="--pool
code-interpreter-v1=2"`, which `run.sh` sets by default).
"""

from __future__ import annotations

import base64
import os

import httpx
import pytest

from e2b_code_interpreter import Sandbox

from conftest import SANDBOX_URL, Tracker, api, poll

TEMPLATE = "code-interpreter-v1"

pytestmark = pytest.mark.skipif(
    os.environ.get("CUBICLE_E2E_SKIP_CI") == "1", reason="CUBICLE_E2E_SKIP_CI=1"
)

ENVS = {"CB_G": "global-value", "CB_Q": "it's \"quoted\""}


@pytest.fixture(scope="module")
def ci(module_sandboxes: Tracker) -> Sandbox:
    sbx = Sandbox.create(TEMPLATE, envs=ENVS, request_timeout=1200, timeout=900)
    module_sandboxes.track(sbx.sandbox_id)
    return sbx


def out(ex) -> str:
    assert ex.error is None, ex.error
    return "".join(ex.logs.stdout)


def test_default_contexts_in_creation_order(ci: Sandbox):
    ctxs = ci.list_code_contexts()
    assert [c.language for c in ctxs[:2]] == ["python", "javascript"], ctxs
    assert all(c.cwd == "/home/user" for c in ctxs[:2])
    new = ci.create_code_context(language="bash")
    try:
        assert ci.list_code_contexts()[-1].id == new.id
    finally:
        ci.remove_code_context(new)


def test_sandbox_envs_in_python_js_bash(ci: Sandbox):
    assert ci.run_code("import os; os.getenv('CB_G')").text == "global-value"
    assert out(ci.run_code("import os; print(os.environ['CB_Q'])")) == "it's \"quoted\"\n"
    # E2B's own variables too
    assert ci.run_code("import os; os.getenv('E2B_SANDBOX_ID')").text == ci.sandbox_id
    assert ci.run_code("process.env.CB_G", language="javascript").text == "global-value"
    assert out(ci.run_code("echo $CB_G", language="bash")) == "global-value\n"
    # a subprocess of the kernel inherits them
    assert ci.run_code("import subprocess; subprocess.run(['sh', '-c', 'echo $CB_G'], capture_output=True, text=True).stdout.strip()").text == "global-value"


def test_per_run_envs_restore_the_sandbox_value(ci: Sandbox):
    ex = ci.run_code("import os; os.getenv('CB_G')", envs={"CB_G": "override"})
    assert ex.text == "override"
    assert ci.run_code("import os; os.getenv('CB_G')").text == "global-value"
    ex = ci.run_code("process.env.CB_G", language="javascript", envs={"CB_G": "js-override"})
    assert ex.text == "js-override"
    assert ci.run_code("process.env.CB_G", language="javascript").text == "global-value"
    assert out(ci.run_code("echo $CB_G", language="bash", envs={"CB_G": "b"})) == "b\n"
    assert out(ci.run_code("echo $CB_G", language="bash")) == "global-value\n"
    # a variable the sandbox does not have is removed again
    assert ci.run_code("import os; os.getenv('CB_ONLY')", envs={"CB_ONLY": "x"}).text == "x"
    assert ci.run_code("import os; repr(os.getenv('CB_ONLY'))").text == "None"


def test_kernels_run_as_root_any_cwd(ci: Sandbox):
    assert ci.run_code("import os; os.getuid()").text == "0"
    ctx = ci.create_code_context(cwd="/root")
    try:
        assert ctx.cwd == "/root"
        assert ci.run_code("import os; os.getcwd()", context=ctx).text == "/root"
        ex = ci.run_code("open('written-by-root.txt', 'w').write('x')", context=ctx)
        assert ex.error is None, ex.error
        # the context's env vars too
        assert ci.run_code("import os; os.getenv('CB_G')", context=ctx).text == "global-value"
    finally:
        ci.remove_code_context(ctx)
    js = ci.create_code_context(cwd="/root", language="javascript")
    try:
        assert ci.run_code("Deno.cwd()", context=js).text == "/root"
    finally:
        ci.remove_code_context(js)


def is_png(b64: str | None) -> bool:
    return bool(b64) and base64.b64decode(b64).startswith(b"\x89PNG")


def test_pil_save_and_savefig_return_png(ci: Sandbox):
    ex = ci.run_code(
        "from PIL import Image\n"
        "img = Image.new('RGB', (8, 8), color='red')\n"
        "img.save('red.png')"
    )
    assert ex.error is None, ex.error
    assert [r for r in ex.results if is_png(r.png)], ex.results
    # the file was written too
    assert ci.run_code("import os; os.path.getsize('red.png') > 0").text == "True"
    ex = ci.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.figure()\nplt.plot([1, 2], [3, 4])\nplt.savefig('fig.png')"
    )
    assert ex.error is None, ex.error
    assert [r for r in ex.results if is_png(r.png)], ex.results


CHARTS = {
    "line": "plt.plot([1, 2, 3], [1, 4, 9], label='sq')\nplt.xlabel('x')\nplt.ylabel('y')\nplt.title('Line')",
    "scatter": "plt.scatter([1, 2, 3], [3, 1, 2], label='pts')\nplt.xlabel('x')\nplt.ylabel('y')\nplt.title('Scatter')",
    "bar": "plt.bar(['a', 'b', 'c'], [3, 5, 2], label='n')\nplt.xlabel('k')\nplt.ylabel('v')\nplt.title('Bar')",
    "pie": "plt.pie([30, 70], labels=['x', 'y'])\nplt.title('Pie')",
    # as in E2B's own test: `labels=` (matplotlib 3.10, as upstream pins) and
    # `patch_artist=True` (boxes as patches: e2b-charts' sign of a box plot)
    "box_and_whisker": "plt.boxplot([[85, 90, 78, 92, 88], [95, 89, 76, 91, 84, 87]], labels=['A', 'B'], patch_artist=True)\nplt.xlabel('g')\nplt.ylabel('v')\nplt.title('Box')",
}


TITLES = {"line": "Line", "scatter": "Scatter", "bar": "Bar", "pie": "Pie", "box_and_whisker": "Box"}


@pytest.mark.parametrize("kind", list(CHARTS))
def test_chart_types(ci: Sandbox, kind: str):
    ex = ci.run_code("import matplotlib.pyplot as plt\nplt.figure()\n" + CHARTS[kind] + "\nplt.show()")
    assert ex.error is None, ex.error
    charts = [r.chart for r in ex.results if r.chart is not None]
    assert len(charts) == 1, ex.results
    c = charts[0]
    assert c.type.value == kind
    assert c.title == TITLES[kind]
    assert c.elements, c.to_dict()
    if kind in ("line", "scatter", "bar", "box_and_whisker"):
        assert c.x_label and c.y_label, c.to_dict()
    if kind == "box_and_whisker":
        # upstream's expected figures for the same data
        assert [e.label for e in c.elements] == ["A", "B"]
        assert [e.median for e in c.elements] == [88, 88]
        assert [e.outliers for e in c.elements] == [[], [76]]


def test_supergraph(ci: Sandbox):
    ex = ci.run_code(
        "import matplotlib.pyplot as plt\n"
        "fig, (a, b) = plt.subplots(1, 2)\n"
        "a.plot([1, 2], [2, 1]); a.set_title('L')\n"
        "b.bar(['p', 'q'], [1, 2]); b.set_title('B')\n"
        "fig.suptitle('Both')\nplt.show()"
    )
    assert ex.error is None, ex.error
    charts = [r.chart for r in ex.results if r.chart is not None]
    assert len(charts) == 1, ex.results
    c = charts[0]
    assert c.type.value == "superchart"
    assert c.title == "Both"
    assert [e.type.value for e in c.elements] == ["line", "bar"]


def test_dataframe_data_is_column_lists(ci: Sandbox):
    ex = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert ex.results[0].data == {"a": [1, 2], "b": ["x", "y"]}


def rtext(ex) -> str:
    """IRkernel sends values as display data (not an execute result): as upstream, the
    value is `results[0].text`."""
    assert ex.error is None, ex.error
    assert ex.results, ex
    return ex.results[0].text.strip()


def test_r_kernel(ci: Sandbox):
    assert rtext(ci.run_code("x <- 41\nx + 1", language="r")) == "[1] 42"
    assert rtext(ci.run_code("x * 2", language="r")) == "[1] 82"
    assert rtext(ci.run_code("getwd()", language="r")) == '[1] "/home/user"'
    assert rtext(ci.run_code('Sys.getenv("CB_G")', language="r")) == '[1] "global-value"'
    ex = ci.run_code('Sys.getenv("CB_G")', language="r", envs={"CB_G": "r-override"})
    assert rtext(ex) == '[1] "r-override"'
    assert rtext(ci.run_code('Sys.getenv("CB_G")', language="r")) == '[1] "global-value"'
    ex = ci.run_code("Sys.getenv('FOO', unset = 'default')", language="r", envs={"FOO": "bar"})
    assert rtext(ex) == '[1] "bar"'
    ex = ci.run_code("Sys.getenv('FOO', unset = 'default')", language="r")
    assert rtext(ex) == '[1] "default"'
    ex = ci.run_code('stop("boom")', language="r")
    assert ex.error is not None and "boom" in ex.error.value
    ctx = ci.create_code_context(language="r", cwd="/tmp")
    try:
        assert rtext(ci.run_code("getwd()", context=ctx)) == '[1] "/tmp"'
        assert rtext(ci.run_code("exists('x')", context=ctx)) == "[1] FALSE"
    finally:
        ci.remove_code_context(ctx)


def test_java_kernel(ci: Sandbox):
    ex = ci.run_code("int x = 41;\nx + 1", language="java", timeout=120)
    assert ex.error is None, ex.error
    assert ex.text == "42"
    assert out(ci.run_code('System.out.println("hi " + x);', language="java")) == "hi 41\n"
    assert ci.run_code('System.getenv("CB_G")', language="java").text == "global-value"
    # upstream's way: the sandbox's variables as system properties too
    assert ci.run_code('System.getProperty("CB_G")', language="java").text == "global-value"
    assert ci.run_code('System.getProperty("user.dir")', language="java").text == "/home/user"
    ex = ci.run_code('System.getProperty("CB_P")', language="java", envs={"CB_P": "jp"})
    assert ex.text == "jp"
    assert ci.run_code('String.valueOf(System.getProperty("CB_P"))', language="java").text == "null"
    ex = ci.run_code("int y = ;", language="java")
    assert ex.error is not None
    ctx = ci.create_code_context(language="java", cwd="/tmp")
    try:
        ex = ci.run_code('new java.io.File(".").getAbsoluteFile().getParent()', context=ctx, timeout=120)
        assert ex.text == "/tmp", (ex.error, ex.results)
    finally:
        ci.remove_code_context(ctx)


def test_execute_checks_the_access_token(ci: Sandbox):
    url = f"{SANDBOX_URL}/execute"
    headers = {"E2b-Sandbox-Id": ci.sandbox_id, "E2b-Sandbox-Port": "49999"}
    body = {"code": "1+1", "context_id": None, "language": None, "env_vars": None}
    for token in (None, "wrong-token"):
        h = dict(headers)
        if token:
            h["X-Access-Token"] = token
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == 401, (token, r.status_code, r.text)
        assert r.json()["code"] == 401 and r.json()["message"]
    # the SDK's own token works (and the contexts routes need none, as upstream)
    assert ci._envd_access_token
    h = dict(headers, **{"X-Access-Token": ci._envd_access_token})
    r = httpx.post(url, json=body, headers=h, timeout=30)
    assert r.status_code == 200 and '"text":"2"' in r.text.replace(" ", "")
    assert httpx.get(f"{SANDBOX_URL}/contexts", headers=headers, timeout=30).status_code == 200


def test_pooled_create_with_envs(module_sandboxes: Tracker):
    before = api("GET", "/cubicle/pool").json()
    if not before.get("target", {}).get(TEMPLATE):
        pytest.skip("the server runs no code-interpreter pool (CUBICLE_E2E_SERVE_ARGS)")
    sbx = Sandbox.create(TEMPLATE, envs={"CB_POOL": "claimed"}, request_timeout=120)
    module_sandboxes.track(sbx.sandbox_id)
    # (a replica sums its nodes' pool figures as it last polled them, ≤ 0.5 s old)
    after = poll(lambda: (a := api("GET", "/cubicle/pool").json())["claims"] > before["claims"] and a, timeout=5)
    assert after and after["claims"] == before["claims"] + 1, (before, after)
    # a fresh kernel: the warm-up and set-up executions did not count
    assert sbx.run_code("1+1").execution_count == 1
    assert sbx.run_code("import os; os.getenv('CB_POOL')").text == "claimed"
    assert sbx.run_code("process.env.CB_POOL", language="javascript").text == "claimed"
    assert sbx.run_code("import os; os.getenv('E2B_SANDBOX_ID')").text == sbx.sandbox_id
    assert sbx.run_code("import os; os.getuid()").text == "0"
    assert sbx.commands.run("whoami").stdout.strip() == "user"
    assert sbx.commands.run("echo $CB_POOL").stdout.strip() == "claimed"
    sbx.kill()
