#!/usr/bin/env python3
"""Self-test of scripts/layers.py on a tiny fake tree: an upward import fails, a baselined
one passes, a baseline line that no longer holds fails, `crate::{..}` groups and comments
are read right; an import cycle fails, within one layer too and round more than two modules,
unless the baseline lists it."""

import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
LAYERS = """
[[layers]]
name = "low"
modules = ["ids", "timefmt", "sas"]
[[layers]]
name = "mid"
modules = ["shard", "store"]
[[layers]]
name = "high"
modules = ["api", "lib"]
"""


def run(root: pathlib.Path) -> tuple[int, str]:
    p = subprocess.run([sys.executable, str(HERE / "layers.py"), "--root", str(root)], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def tree(files: dict[str, str], baseline: str = "", layers: str = LAYERS) -> pathlib.Path:
    root = pathlib.Path(tempfile.mkdtemp())
    (root / "scripts").mkdir()
    (root / "scripts" / "layers.toml").write_text(layers)
    (root / "scripts" / "layers-baseline.txt").write_text(baseline)
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def check(name: str, files: dict[str, str], baseline: str, want_ok: bool, want_text: str, layers: str = LAYERS) -> None:
    root = tree(files, baseline, layers)
    try:
        code, out = run(root)
    finally:
        shutil.rmtree(root)
    assert (code == 0) == want_ok, f"{name}: exit {code}\n{out}"
    assert want_text in out, f"{name}: {want_text!r} not in\n{out}"
    print(f"ok: {name}")


down = {"ids.rs": "pub fn f() {}", "shard/mod.rs": "use crate::ids::f;\n// crate::api in a comment\nconst S: &str = \"crate::api\";", "api.rs": "use crate::{shard, ids::f};"}
check("downward imports pass", down, "", True, "0 new")
# api.rs no longer imports shard here, so the upward edge makes no cycle (checked below).
up = dict(down, **{"shard/devices.rs": "use crate::{ids, api::Thing};", "api.rs": "use crate::ids::f;"})
check("an upward import in a group fails", up, "", False, "new wrong-way import: src/shard/devices.rs -> api")
check("a baselined upward import passes", up, "src/shard/devices.rs -> api\n", True, "1 known")
check("a vanished baseline line fails", down, "src/shard/devices.rs -> api\n", False, "no longer holds")
check("an item of lib.rs is the lib layer", dict(down, **{"ids.rs": "fn g(_: &crate::Shared) {}"}), "", False, "src/ids.rs -> lib")
check("a module in no layer fails", dict(down, **{"extra.rs": ""}), "", False, "in no layer")

# Import cycles between top-level modules, whatever the layers say.
same_layer = dict(down, **{"store.rs": "use crate::shard::State;", "shard/log.rs": "fn f(_: crate::store::Log) {}"})
check("a cycle within one layer fails", same_layer, "", False,
      "new import cycle: shard, store: shard -> store (src/shard/log.rs); store -> shard (src/store.rs)")
check("a baselined cycle passes", same_layer, "cycle: shard, store\n", True, "1 import cycles, 0 new")
check("a vanished cycle line fails", down, "cycle: shard, store\n", False, "cycle: shard, store no longer holds")
ring = dict(down, **{"ids.rs": "pub fn f() { crate::timefmt::g() }", "timefmt.rs": "use crate::sas::h;", "sas.rs": "use crate::{ids};"})
check("a cycle round three modules fails", ring, "", False, "new import cycle: ids, sas, timefmt")
check("a one-way chain in a layer passes", dict(down, **{"ids.rs": "pub fn f() { crate::timefmt::g() }", "timefmt.rs": "use crate::sas::h;"}), "", True, "0 import cycles")
check("an upward import that closes a loop is also a cycle", dict(down, **{"shard/devices.rs": "use crate::api::Thing;"}),
      "src/shard/devices.rs -> api\n", False, "new import cycle: api, shard")

# A sealed module: only the importers it names may import it, even from a higher layer, and the
# baseline cannot excuse it (how `cluster` is kept behind app::directory).
SEALED = LAYERS + '''
[[sealed]]
module = "store"
importers = ["lib"]
'''
check("a sealed module imported by its importer passes", dict(down, **{"lib.rs": "use crate::store::Log;", "store.rs": ""}), "", True,
      "0 imports of sealed modules: ok", SEALED)
check("a sealed module imported from a higher layer fails", dict(down, **{"store.rs": "", "api.rs": "fn f() { crate::store::open() }"}), "", False,
      "sealed module imported: src/api.rs -> store (only lib may import it)", SEALED)
SEALED_API = LAYERS + '''
[[sealed]]
module = "api"
importers = ["lib"]
'''
check("a baseline line cannot excuse a sealed import", dict(down, **{"shard/devices.rs": "use crate::api::Thing;", "api.rs": "use crate::ids::f;"}),
      "src/shard/devices.rs -> api\n", False, "sealed module imported: src/shard/devices.rs -> api (only lib may import it)", SEALED_API)
