"""Spec checks beyond the schema: bounded error messages, and names resolved against the registries."""

from __future__ import annotations

import math
import re
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
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"] and e["type"] == "value_error":  # a whole-spec check: its message names the field
            lines.append(f"  {msg}")
            continue
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
        config = hf_model_config(model.name.removeprefix("hf:"), model.overrides)
        if model.lora is not None:
            check_lora_targets(config, model.lora)
        return
    from prefixflow.model.models import check_model

    check_model(model.name, model.overrides)


def check_lora_targets(config, lora) -> None:
    """Resolve ``lora.target_modules`` against the model's linear layers, built on the meta device (no
    weights); ValueError naming the field otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.spec.lora import target_modules

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    target_modules(model, lora)


def hf_model_config(name: str, overrides: dict[str, Any] | None = None):
    """``prefixflow.integrations.hf.hf_config(name, overrides)`` with every failure as one ValueError naming
    the field (transformers' own type checks raise other exceptions; a deeply nested config.json recurses),
    and the values the harness cannot train exactly refused (:func:`check_hf_values`)."""
    try:
        from prefixflow.integrations.hf import hf_config
        from prefixflow.integrations.hf_configs import TYPE_ADVICE
    except ImportError as e:
        raise ValueError(f"hf: models need the hf extra (pip install -e '.[hf]'): {e}") from None
    from harness.vlm_models import is_vlm_name, vlm_config

    if is_vlm_name(name):
        hf_config = vlm_config  # noqa: F811 - pf-bench's built-in vision-language configs (harness.vlm_models)
    try:
        config = hf_config(name, overrides)
    except RecursionError:
        raise ValueError(f"hf:{_clip(name)}: its config.json nests too deeply; not a model config") from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub's StrictDataclassError, TypeError, ...
        field = _FIELD.search(str(e))
        where = (
            f"override {field.group(1)}={short((overrides or {}).get(field.group(1)))}" if field else "config"
        )
        cause = str(e).strip().splitlines()[-1].strip()
        raise ValueError(f"hf:{_clip(name)}: {where}: {_clip(cause, 200)}; {TYPE_ADVICE}") from None
    check_hf_values(config, f"hf:{_clip(name)}")
    return config


def _clip(text: str, limit: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FIELD = re.compile(r"field '([A-Za-z0-9_.]{1,80})'")
_POSITIVE_REALS = ("rms_norm_eps", "rope_theta", "layer_norm_eps")


def check_hf_values(config, where: str) -> None:
    """The config values that pass transformers' checks but would fail inside a cell or break exactness:
    dropout (training would differ from the baseline), an unknown ``hidden_act``, a ``sliding_window`` below 1,
    a zero, negative or non-finite epsilon or RoPE base."""
    from transformers.activations import ACT2FN

    values = config.to_dict()
    for key, value in values.items():
        is_rate = key.endswith("dropout") or key.endswith("pdrop") or key.endswith("dropout_prob")
        if is_rate and isinstance(value, int | float) and not isinstance(value, bool) and value != 0:
            raise ValueError(
                f"{where}: {key}={short(value)}: dropout makes training differ from the baseline (PrefixFlow is "
                f"exact only without it); set {key}=0.0"
            )
    act = values.get("hidden_act")
    if act is not None and (not isinstance(act, str) or act not in ACT2FN):
        raise ValueError(
            f"{where}: hidden_act={short(act)} is not an activation transformers knows; one of "
            f"{', '.join(sorted(ACT2FN))}"
        )
    window = values.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window={short(window)} must be an int >= 1, or null (no window)")
    for key in _POSITIVE_REALS:
        value = values.get(key)
        if isinstance(value, int | float) and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {key}={short(value)} must be a finite number > 0")
