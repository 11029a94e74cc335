"""Spec checks beyond the schema: bounded error messages, and names resolved against the registries."""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from harness.spec.cell import ModelSpec
    from harness.spec.schema import Spec

_REPR = reprlib.Repr()  # bounded: reprlib stops at these sizes instead of walking the whole value
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple = 2, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40
MAX_LISTED_ERRORS = 10


def short(value: Any, limit: int = 100) -> str:
    """A bounded repr of (possibly huge, untrusted) input for error messages."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_validation_error(err: ValidationError, source: str) -> str:
    errors = err.errors()
    lines = [f"{source}: invalid spec"]
    for e in errors[:MAX_LISTED_ERRORS]:
        loc = (
            ".".join(str(p) if len(str(p)) <= 40 else f"{str(p)[:37]}..." for p in e["loc"]) or "(top level)"
        )
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check its spelling)"
        elif e["type"] == "literal_error" and e.get("ctx", {}).get("expected"):
            msg = f"not allowed; allowed: {e['ctx']['expected']}"
        lines.append(f"  {loc}: {msg} (got {short(e.get('input'))})")
    if len(errors) > MAX_LISTED_ERRORS:
        lines.append(f"  ... and {len(errors) - MAX_LISTED_ERRORS} more")
    return "\n".join(lines)


def check_registries(spec: Spec, source: str) -> None:
    """Resolve every system name against the system registry, and every model (name + overrides) against
    the model registry without building it: a typo fails here, not in each cell."""
    from harness.contenders import available_contenders

    known = available_contenders()
    named = [("systems", spec.systems)]
    named += [(f"axes[{i}].systems", b.systems or []) for i, b in enumerate(spec.axes_blocks)]
    named += [(f"frontier[{i}].variants", [v.removesuffix("+offload") for v in f.variants])
              for i, f in enumerate(spec.frontier)]  # fmt: skip
    for where, names in named:
        for name in names:
            if name not in known:
                raise ValueError(
                    f"{source}: {where}: unknown system {name!r}; registered: {', '.join(known)}"
                )
    models = [
        (f"axes[{i}].models[{j}]", m) for i, b in enumerate(spec.axes_blocks) for j, m in enumerate(b.models)
    ]
    models += [(f"frontier[{i}].model", f.model) for i, f in enumerate(spec.frontier) if f.model is not None]
    for where, model in models:
        try:
            check_model_spec(model)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {where} ({model.name}): {e}") from None


def check_model_spec(model: ModelSpec) -> None:
    """Resolve a model name and its overrides against the model registry (TorchTitan, or ``hf:`` configs)
    without building it; ValueError naming the field otherwise."""
    if model.name.startswith("hf:"):
        try:
            from prefixflow.integrations.hf import hf_config
        except ImportError as e:
            raise ValueError(f"hf: models need the hf extra (pip install -e '.[hf]'): {e}") from None
        hf_config(model.name.removeprefix("hf:"), model.overrides)
        return
    from prefixflow.models import check_model

    check_model(model.name, model.overrides)
