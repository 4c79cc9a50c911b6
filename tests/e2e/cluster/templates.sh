# shellcheck shell=bash
# Templates for the e2e suites' nodes (sourced by tests/e2e/cluster/moving.sh and
# lost_paused.sh): `seed_template FROM TO NAME` gives state dir TO template NAME — from
# state dir FROM when it has it (layers copied, or hard-linked with LINK=1: the layer
# store never writes a layer it stored), else built (`cubicle template build`). Needs BIN.

template_layers() { # state name → its layer ids
  /usr/bin/python3 -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1])).get("layers", [])))' \
    "$1/templates/$2/template.json"
}

seed_template() { # from to name
  local l
  [[ -f $2/templates/$3/template.json ]] && return 0
  if [[ -f $1/templates/$3/template.json ]]; then
    mkdir -p "$2/templates" "$2/layers" || return 1
    for l in $(template_layers "$1" "$3"); do
      if [[ ${LINK:-} == 1 ]]; then
        [[ -e $2/layers/$l ]] || cp -al "$1/layers/$l" "$2/layers/" || return 1
      else
        [[ -e $2/layers/$l ]] || cp -a --reflink=auto "$1/layers/$l" "$2/layers/" || return 1
      fi
      cp -a "$1/layers/$l.json" "$2/layers/" || return 1
    done
    cp -a "$1/templates/$3" "$2/templates/"
  else
    "$BIN" template build "$3" --state-dir "$2"
  fi
}
