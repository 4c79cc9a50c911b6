"""cubicle_kernel: a small Jupyter kernel for Python, the default of `code-interpreter-v1`.

It speaks the Jupyter messaging protocol (5.3) with pyzmq directly, without an event-loop
framework, and executes through IPython's `InteractiveShell`, so what code does is
IPython's: magics, `!cmd`, `display()`, the rich formatters, `matplotlib_inline`
figures, tracebacks. ipykernel spends 3.5-6 ms of CPU per trivial execution in its
machinery (tornado/anyio loops, an IOPub thread, message classes); this file does the
same protocol work in a fraction of that. ipykernel stays installed as the kernelspec
`python3-ipykernel` (see docs/interpreter.md to switch back).

Channels: shell (ROUTER, served by the main thread, which also runs the code so SIGINT
interrupts it), control (ROUTER, its own thread: kernel_info, interrupt by SIGINT to
this process, shutdown), iopub (PUB, shared under a lock), heartbeat (echo in a
thread), stdin (bound, unused: input() raises StdinNotImplementedError as ipykernel
does without allow_stdin). File descriptors 1 and 2 are pipes read by a flusher thread,
so output of subprocesses and C code reaches the client as stream messages in real time
(buffered up to FLUSH_INTERVAL), as Python-level writes do.

Run as `python -m cubicle_kernel -f <connection file> [--Class.trait=value ...]`.
"""

import binascii
import codecs
import datetime
import hashlib
import hmac
import io
import json
import math
import numbers
import os
import select
import signal
import sys
import threading

import zmq

PROTOCOL_VERSION = "5.3"
DELIM = b"<IDS|MSG>"
# Longest time output stays buffered before it is sent while code runs.
FLUSH_INTERVAL = 0.05


def _log(msg):
    try:
        os.write(_LOG_FD, f"[cubicle_kernel] {msg}\n".encode(errors="replace"))
    except OSError:
        pass


_LOG_FD = 2


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _json_default(obj):
    """What json.dumps cannot encode: bytes as base64 (images), dates, numbers, iterables."""
    if isinstance(obj, bytes):
        return binascii.b2a_base64(obj, newline=False).decode("ascii")
    if isinstance(obj, (datetime.datetime, datetime.date)):
        return obj.isoformat()
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, (set, frozenset, tuple)) or hasattr(obj, "__iter__"):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _no_nan(obj):
    """A copy of obj with non-finite floats as their repr (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, dict):
        return {str(k): _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_no_nan(v) for v in obj]
    return obj


def _dumps(obj):
    try:
        return json.dumps(obj, default=_json_default, ensure_ascii=False, allow_nan=False).encode(
            "utf8", "surrogateescape"
        )
    except ValueError:
        return json.dumps(_no_nan(obj), default=_json_default, ensure_ascii=False).encode(
            "utf8", "surrogateescape"
        )


class Wire:
    """Framing and HMAC signing of messages with the connection file's key."""

    def __init__(self, key, scheme):
        if scheme not in ("hmac-sha256", ""):
            raise ValueError(f"unsupported signature scheme {scheme!r}")
        self.mac = hmac.new(key, digestmod=hashlib.sha256) if key else None
        self.session = os.urandom(16).hex()

    def sign(self, parts):
        if self.mac is None:
            return b""
        h = self.mac.copy()
        for p in parts:
            h.update(p)
        return h.hexdigest().encode()

    def unpack(self, frames):
        """(identities, header, raw header, content) of a request; ValueError if invalid."""
        i = frames.index(DELIM)
        if len(frames) < i + 6:
            raise ValueError("truncated message")
        sig, parts = frames[i + 1], frames[i + 2 : i + 6]
        if self.mac is not None and not hmac.compare_digest(sig, self.sign(parts)):
            raise ValueError("bad message signature")
        return frames[:i], json.loads(parts[0]), parts[0], json.loads(parts[3])

    def pack(self, msg_type, content, parent_raw, metadata=b"{}"):
        header = (
            '{"msg_id": "%s", "msg_type": "%s", "username": "kernel", "session": "%s", '
            '"date": "%s", "version": "%s"}'
            % (os.urandom(16).hex(), msg_type, self.session, _now(), PROTOCOL_VERSION)
        ).encode()
        body = _dumps(content)
        return [DELIM, self.sign((header, parent_raw, metadata, body)), header, parent_raw, metadata, body]


class Output(io.TextIOBase):
    """sys.stdout / sys.stderr: text buffered in the kernel, sent as `stream` messages."""

    def __init__(self, kernel, name, fd):
        super().__init__()
        self._kernel, self.name, self._fd = kernel, name, fd
        self._child = []  # text written by a forked child, not yet on the pipe

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
        return "strict"

    def writable(self):
        return True

    def isatty(self):
        return False

    def fileno(self):
        # The pipe the flusher reads: writes to it are output too.
        return self._fd

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if s:
            if os.getpid() != self._kernel.pid:
                # A forked child (multiprocessing): no flusher thread there; whole lines
                # go to the pipe on this fd (the parent's, which sends what arrives).
                self._child.append(s)
                if "\n" in s:
                    self._write_child()
            else:
                self._kernel.buffer_output(self.name, s)
        return len(s)

    def _write_child(self):
        data, self._child[:] = "".join(self._child).encode("utf-8", "replace"), []
        while data:
            data = data[os.write(self._fd, data) :]

    def flush(self):
        if os.getpid() == self._kernel.pid:
            self._kernel.flush_output()
        elif self._child:
            self._write_child()


class Kernel:
    def __init__(self, conn, config):
        global _LOG_FD
        self.wire = Wire(conn.get("key", "").encode(), conn.get("signature_scheme", "hmac-sha256"))
        self.ctx = zmq.Context()
        ip, transport = conn.get("ip", "127.0.0.1"), conn.get("transport", "tcp")

        def bind(kind, port):
            s = self.ctx.socket(kind)
            s.linger = 1000
            s.bind(f"{transport}://{ip}:{port}")
            return s

        self.shell_sock = bind(zmq.ROUTER, conn["shell_port"])
        self.control_sock = bind(zmq.ROUTER, conn["control_port"])
        self.iopub = bind(zmq.PUB, conn["iopub_port"])
        self.stdin_sock = bind(zmq.ROUTER, conn["stdin_port"])
        hb = bind(zmq.ROUTER, conn["hb_port"])
        threading.Thread(target=self._heartbeat, args=(hb,), daemon=True, name="heartbeat").start()

        # Everything touching iopub or the output buffers holds this lock.
        self.lock = threading.RLock()
        self.pid = os.getpid()
        self.main_thread = threading.get_ident()
        # An interrupt that came while the main thread was sending a multipart message
        # (raised once the message is out, so no half message is left on the socket).
        self.in_send = False
        self.interrupt_pending = False
        self.parent = b"{}"
        self.buffers = {"stdout": [], "stderr": []}
        self.first_buffered = None
        # fd 1 and 2 become pipes read by the flusher; the original stderr stays for logs.
        _LOG_FD = os.dup(2)
        self.pipes = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.pipes[r] = (name, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        sys.stdout = Output(self, "stdout", 1)
        sys.stderr = Output(self, "stderr", 2)
        threading.Thread(target=self._flusher, daemon=True, name="output").start()

        self.shell = _make_shell(self, config)
        threading.Thread(target=self._control, daemon=True, name="control").start()

    # ---- iopub and output ----

    def publish(self, msg_type, content, parent=None):
        if os.getpid() != self.pid:
            return  # display() in a forked child: its sockets are the parent's
        frames = [b"kernel." + msg_type.encode()] + self.wire.pack(
            msg_type, content, self.parent if parent is None else parent
        )
        with self.lock:
            if threading.get_ident() != self.main_thread:
                self.iopub.send_multipart(frames)
                return
            self.in_send = True
            try:
                self.iopub.send_multipart(frames)
            finally:
                self.in_send = False
            if self.interrupt_pending:
                self.interrupt_pending = False
                raise KeyboardInterrupt

    def on_sigint(self, signum, frame):
        """SIGINT while code runs: KeyboardInterrupt, deferred while a message is sent."""
        if self.in_send:
            self.interrupt_pending = True
        else:
            raise KeyboardInterrupt

    def buffer_output(self, name, text):
        with self.lock:
            # What went to the same fd before this write (a subprocess, os.write, C
            # code) comes first: take it off the pipe now rather than when the flusher
            # wakes, which on a loaded host can be after this text.
            self._drain_pipes(name)
            self.buffers[name].append(text)
            if self.first_buffered is None:
                self.first_buffered = _monotonic()
                try:
                    os.write(self.wake_w, b"x")
                except OSError:
                    pass

    def _drain_pipes(self, only=None):
        for r, (name, dec) in self.pipes.items():
            if only is not None and name != only:
                continue
            while True:
                try:
                    data = os.read(r, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if not data:
                    break
                text = dec.decode(data)
                if text:
                    self.buffers[name].append(text)
                    if self.first_buffered is None:
                        self.first_buffered = _monotonic()

    def flush_output(self):
        """Send everything written so far (Python-level and to fd 1/2) as stream messages."""
        with self.lock:
            self._drain_pipes()
            for name, buf in self.buffers.items():
                if buf:
                    text = "".join(buf)
                    buf.clear()
                    self.publish("stream", {"name": name, "text": text})
            self.first_buffered = None

    def _flusher(self):
        fds = list(self.pipes) + [self.wake_r]
        while True:
            with self.lock:
                first = self.first_buffered
            timeout = None if first is None else max(0.0, first + FLUSH_INTERVAL - _monotonic())
            try:
                ready, _, _ = select.select(fds, [], [], timeout)
            except InterruptedError:
                continue
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 4096)
                except OSError:
                    pass
            with self.lock:
                self._drain_pipes()
                first = self.first_buffered
                if first is not None and _monotonic() - first >= FLUSH_INTERVAL:
                    self.flush_output()

    # ---- channels ----

    def _heartbeat(self, sock):
        try:
            zmq.proxy(sock, sock)
        except zmq.ZMQError:
            pass

    def _reply(self, sock, idents, msg_type, content, parent_raw):
        sock.send_multipart(idents + self.wire.pack(msg_type, content, parent_raw))

    def _control(self):
        sock = self.control_sock
        while True:
            try:
                idents, header, raw, content = self.wire.unpack(sock.recv_multipart())
            except zmq.ZMQError:
                return
            except Exception as e:  # a bad message must not end the channel
                _log(f"control: dropping message: {e}")
                continue
            t = header.get("msg_type")
            if t == "kernel_info_request":
                self._reply(sock, idents, "kernel_info_reply", self.kernel_info(), raw)
            elif t == "interrupt_request":
                os.kill(os.getpid(), signal.SIGINT)
                self._reply(sock, idents, "interrupt_reply", {"status": "ok"}, raw)
            elif t == "shutdown_request":
                self._reply(sock, idents, "shutdown_reply", {"status": "ok", "restart": bool(content.get("restart"))}, raw)
                self.exit()
            else:
                _log(f"control: unsupported message type {t}")

    def kernel_info(self):
        import IPython

        return {
            "status": "ok",
            "protocol_version": PROTOCOL_VERSION,
            "implementation": "cubicle_kernel",
            "implementation_version": "1.0",
            "language_info": {
                "name": "python",
                "version": sys.version.split()[0],
                "mimetype": "text/x-python",
                "codemirror_mode": {"name": "ipython", "version": 3},
                "pygments_lexer": "ipython3",
                "nbconvert_exporter": "python",
                "file_extension": ".py",
            },
            "banner": f"Python {sys.version.split()[0]}, IPython {IPython.__version__} (cubicle_kernel)",
            "help_links": [],
        }

    def exit(self):
        try:
            self.flush_output()
            self.shell.atexit_operations()
        finally:
            os._exit(0)

    def serve(self):
        """The shell channel: one request at a time, on the main thread."""
        while True:
            try:
                frames = self.shell_sock.recv_multipart()
            except KeyboardInterrupt:
                continue
            try:
                idents, header, raw, content = self.wire.unpack(frames)
            except Exception as e:
                _log(f"shell: dropping message: {e}")
                continue
            self.parent = raw
            self.publish("status", {"execution_state": "busy"})
            try:
                t = header.get("msg_type")
                handler = self.handlers.get(t)
                if handler is None:
                    _log(f"shell: unsupported message type {t}")
                else:
                    handler(self, idents, raw, content)
            except KeyboardInterrupt:
                pass
            except Exception as e:
                _log(f"shell: {t} failed: {e!r}")
            self.publish("status", {"execution_state": "idle"})
            if self.shell.exit_now:
                self.exit()

    # ---- shell handlers ----

    def on_kernel_info(self, idents, raw, content):
        self._reply(self.shell_sock, idents, "kernel_info_reply", self.kernel_info(), raw)

    def on_execute(self, idents, raw, content):
        shell = self.shell
        code = content.get("code", "")
        silent = bool(content.get("silent", False))
        store_history = bool(content.get("store_history", not silent)) and not silent
        if not silent:
            self.publish("execute_input", {"code": code, "execution_count": shell.execution_count})
        shell._last_traceback = None
        result = None
        try:
            self.interrupt_pending = False
            signal.signal(signal.SIGINT, self.on_sigint)
            try:
                result = shell.run_cell(code, store_history=store_history, silent=silent)
            finally:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        except KeyboardInterrupt:
            # Interrupted outside the code (in IPython's own steps around it).
            shell.showtraceback()
        self.flush_output()
        error = None
        if result is None:
            error = KeyboardInterrupt()
        elif not result.success:
            error = result.error_before_exec if result.error_before_exec is not None else result.error_in_exec
        if error is None:
            reply = {"status": "ok", "user_expressions": {}}
            exprs = content.get("user_expressions") or {}
            if exprs:
                reply["user_expressions"] = shell.user_expressions(exprs)
        else:
            reply = {
                "status": "error",
                "ename": type(error).__name__,
                "evalue": str(error),
                "traceback": shell._last_traceback or [],
            }
        reply["execution_count"] = shell.execution_count - 1
        reply["payload"] = shell.payload_manager.read_payload()
        shell.payload_manager.clear_payload()
        self._reply(self.shell_sock, idents, "execute_reply", reply, raw)

    def on_is_complete(self, idents, raw, content):
        status, indent = self.shell.input_transformer_manager.check_complete(content.get("code", ""))
        reply = {"status": status}
        if status == "incomplete":
            reply["indent"] = " " * (indent or 0)
        self._reply(self.shell_sock, idents, "is_complete_reply", reply, raw)

    def on_complete(self, idents, raw, content):
        code = content.get("code", "")
        pos = content.get("cursor_pos")
        pos = len(code) if pos is None else pos
        text, matches = self.shell.complete("", code, pos)
        reply = {"status": "ok", "matches": matches, "cursor_start": pos - len(text), "cursor_end": pos, "metadata": {}}
        self._reply(self.shell_sock, idents, "complete_reply", reply, raw)

    def on_inspect(self, idents, raw, content):
        from IPython.utils.tokenutil import token_at_cursor

        code = content.get("code", "")
        name = token_at_cursor(code, content.get("cursor_pos", len(code)))
        reply = {"status": "ok", "found": False, "data": {}, "metadata": {}}
        try:
            reply["data"] = self.shell.object_inspect_mime(name, detail_level=content.get("detail_level", 0))
            reply["found"] = True
        except KeyError:
            pass
        self._reply(self.shell_sock, idents, "inspect_reply", reply, raw)

    def on_comm_info(self, idents, raw, content):
        self._reply(self.shell_sock, idents, "comm_info_reply", {"status": "ok", "comms": {}}, raw)

    def on_shutdown(self, idents, raw, content):
        self._reply(self.shell_sock, idents, "shutdown_reply", {"status": "ok", "restart": bool(content.get("restart"))}, raw)
        self.publish("status", {"execution_state": "idle"})
        self.exit()

    handlers = {
        "kernel_info_request": on_kernel_info,
        "execute_request": on_execute,
        "is_complete_request": on_is_complete,
        "complete_request": on_complete,
        "inspect_request": on_inspect,
        "comm_info_request": on_comm_info,
        "shutdown_request": on_shutdown,
    }


_monotonic = __import__("time").monotonic


def _murmur2(data, seed=0xC70F6907):
    """MurmurHash2 (32-bit) of bytes: ipykernel names each cell's code by it."""
    m, n = 0x5BD1E995, len(data)
    h = (seed ^ n) & 0xFFFFFFFF
    end = n & ~3
    for i in range(0, end, 4):
        k = (int.from_bytes(data[i : i + 4], "little") * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[end:]
    if tail:
        h = ((h ^ int.from_bytes(tail, "little")) * m) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def _make_shell(kernel, config):
    """IPython's InteractiveShell with its display hook, display publisher and traceback
    display sending Jupyter messages (what ipykernel's ZMQInteractiveShell does)."""
    from IPython.core.compilerop import CachingCompiler
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.error import StdinNotImplementedError, UsageError
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import CBool, Type

    class KernelDisplayHook(DisplayHook):
        """Publishes the value of a cell's last expression as `execute_result`."""

        def start_displayhook(self):
            self._data, self._md = None, None

        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            self._data, self._md = format_dict, md_dict

        def finish_displayhook(self):
            kernel.flush_output()
            if self._data:
                kernel.publish(
                    "execute_result",
                    {"execution_count": self.prompt_count, "data": self._data, "metadata": self._md or {}},
                )
            self._data = None

    class KernelDisplayPublisher(DisplayPublisher):
        """display(): `display_data` (or `update_display_data`), after pending output."""

        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            kernel.flush_output()
            kernel.publish(
                "update_display_data" if update else "display_data",
                {"data": data, "metadata": metadata or {}, "transient": transient or {}},
            )

        def clear_output(self, wait=False):
            kernel.flush_output()
            kernel.publish("clear_output", {"wait": bool(wait)})

    cell_dir = os.path.join(__import__("tempfile").gettempdir(), f"ipykernel_{os.getpid()}")

    class CellCompiler(CachingCompiler):
        """Names cells `<tmp>/ipykernel_<pid>/<hash>.py` as ipykernel does, so tracebacks
        and error values read the same."""

        def get_code_name(self, raw_code, code, number):
            return os.path.join(cell_dir, f"{_murmur2(raw_code.encode())}.py")

    class KernelShell(InteractiveShell):
        compiler_class = Type(CellCompiler)
        displayhook_class = Type(KernelDisplayHook)
        display_pub_class = Type(KernelDisplayPublisher)
        readline_use = CBool(False)
        autoindent = CBool(False)

        def init_virtualenv(self):
            # The kernel runs in the environment it was started in (as ipykernel).
            pass

        def init_environment(self):
            # What ipykernel sets, so tools behave the same: colours on, no pagers.
            os.environ.update(
                TERM="xterm-color", CLICOLOR="1", FORCE_COLOR="1", CLICOLOR_FORCE="1", PAGER="cat", GIT_PAGER="cat"
            )

        def enable_gui(self, gui=None):
            if gui not in (None, "inline"):
                raise UsageError(f"GUI event loop '{gui}' is not supported in this kernel")

        def _showtraceback(self, etype, evalue, stb):
            kernel.flush_output()
            self._last_traceback = stb
            kernel.publish("error", {"traceback": stb, "ename": etype.__name__, "evalue": str(evalue)})

    shell = KernelShell.instance(config=config)

    def no_stdin(*args, **kwargs):
        raise StdinNotImplementedError("raw_input was called, but this frontend does not support input requests.")

    import builtins
    import getpass

    builtins.input = no_stdin
    getpass.getpass = no_stdin
    # Startup files of the IPython profile, as ipykernel's application runs them.
    startup = getattr(shell.profile_dir, "startup_dir", None)
    if startup and os.path.isdir(startup):
        for f in sorted(os.listdir(startup)):
            path = os.path.join(startup, f)
            if f.endswith(".py"):
                shell.safe_execfile(path, shell.user_ns)
            elif f.endswith(".ipy"):
                shell.safe_execfile_ipy(path)
    return shell


def _config(args):
    """traitlets config from `--Class.trait=value` arguments (e.g. the interpreter's
    `--HistoryManager.hist_file=:memory:`)."""
    import ast

    from traitlets.config import Config

    cfg = Config()
    for a in args:
        if not a.startswith("--") or "=" not in a:
            continue
        name, value = a[2:].split("=", 1)
        if "." not in name:
            continue
        cls, trait = name.rsplit(".", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        cfg[cls][trait] = value
    return cfg


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-f" not in argv or argv.index("-f") + 1 >= len(argv):
        sys.exit("usage: python -m cubicle_kernel -f <connection file> [--Class.trait=value ...]")
    with open(argv[argv.index("-f") + 1]) as f:
        conn = json.load(f)
    # The working directory ('') importable after the standard library and before
    # site-packages, where IPython's kernel application puts it (not this file's dir).
    if sys.path and sys.path[0] in ("", os.getcwd(), os.path.dirname(os.path.abspath(__file__))):
        del sys.path[0]
    if "" not in sys.path:
        at = next((i for i, p in enumerate(sys.path) if os.path.basename(p) in ("site-packages", "dist-packages")), 0)
        sys.path.insert(at, "")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel = Kernel(conn, _config(argv))
    kernel.serve()


if __name__ == "__main__":
    # Run as the importable module, not as __main__ (IPython takes that name for the
    # user's namespace).
    import cubicle_kernel

    cubicle_kernel.main()
