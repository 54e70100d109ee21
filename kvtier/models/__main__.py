"""``python -m kvtier.models [NAME ...]``: prepare the named bundled models (all without names); set-up runs it."""

from __future__ import annotations

import sys

from kvtier.models import MODELS, ModelError, bundled, ensure_model


def main(argv: list[str]) -> int:
    try:
        for model in [bundled(n) for n in argv] or list(MODELS.values()):
            print(f"{model.name}: {ensure_model(model=model)}", flush=True)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
