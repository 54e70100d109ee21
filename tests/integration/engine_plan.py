"""Several in-process engine runs of the test drivers, one after the other, in ONE process::

    python tests/integration/engine_plan.py '[["shared_vllm_driver.py", "--model", ...], ["sharedfs_driver.py", "b", ...]]'

Each entry names a driver in this folder and its arguments. A driver here has ``_parser()`` and
``run(args)``, which serves its scenario with an engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
and returns that engine. After each run the engine is shut down and every kvtier store of this
process is closed (its RAM, SSD index and shared-tier client), so the next run's engine starts with
new, empty tiers, as a new machine would; only the interpreter's start-up and imports are shared.
``<out>.done`` appears once a run's engine is down (``--out`` of that run).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _driver(name: str):
    path = HERE / name
    if path.parent != HERE or not path.is_file():
        raise SystemExit(f"no driver {name!r} in {HERE}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def close(llm) -> None:
    """Shut ``llm`` down and close this process's kvtier stores."""
    from kvtier import store

    llm.llm_engine.engine_core.shutdown()
    for s in list(store._registry.values()):
        s.close()
    del llm
    gc.collect()


def main() -> int:
    sys.path.insert(0, str(HERE))
    for entry in json.loads(sys.argv[1]):
        mod = _driver(entry[0])
        args = mod._parser().parse_args(entry[1:])
        close(mod.run(args))
        Path(args.out).with_suffix(".done").write_text("")
    return 0


if __name__ == "__main__":
    sys.exit(main())
