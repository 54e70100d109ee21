"""The shared ``--dtype`` option: auto|bfloat16|float32|float16, resolved by kvtier.compute.choose_dtype."""

from __future__ import annotations

import typer

from kvtier.compute import DtypeChoice, DtypeError, announce, choose_dtype

HELP = ("Compute dtype: auto (bfloat16 on a CPU with native bf16, float32 otherwise; $KVTIER_DTYPE "
        "overrides auto), bfloat16, float32 or float16.")


def dtype_option() -> typer.models.OptionInfo:
    return typer.Option("auto", "--dtype", help=HELP)


def resolve_cli_dtype(value: str | None, *, say: bool = True) -> DtypeChoice:
    """The choice for a ``--dtype`` value (said once on stderr); a bad name -> typer.BadParameter."""
    try:
        choice = choose_dtype(value, source="cli")
    except DtypeError as e:
        raise typer.BadParameter(str(e), param_hint="--dtype") from None
    if say:
        announce(choice)
    return choice
