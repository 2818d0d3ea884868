"""Hugging Face custom-code classes for ACRE exports (``trust_remote_code`` loading).

``AcreConfig`` (``model_type = "acre"``) holds every field of the base model's config plus
``base_model_type`` and an ``acre`` section; ``AcreForCausalLM`` builds the base architecture from
that config with transformers' own classes and calls ``attach_acre`` with the recorded options. Its parameter names are the
trained model's (``model.layers.N.self_attn.acre_q_proj.weight`` ...), so checkpoints and exports
share one naming.

Exports copy this file and its relative imports (``adapter``, ``interleave``, ``visibility``), so this
package stays self-contained: relative imports; torch, transformers and numpy only.

Two export forms:

* full: every weight in the export folder (self-contained);
* adapter-only (``config.adapter_only``): only the L1 weights, and ``base_model_name_or_path``
  pointing at the base model (a local folder, absolute or relative to the export, or a hub id).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .adapter import attach_from_section, check_supported, load_acre_state_dict

ACRE_EXPORT_FORMAT = 1
# Fields of a config dict that describe the file, not the architecture.
_NOT_BASE_FIELDS = {
    "model_type", "architectures", "auto_map", "transformers_version", "base_model_type", "acre",
    "adapter_only", "base_model_name_or_path", "_name_or_path",
}
ADAPTER_WEIGHTS = "acre_adapter.safetensors"


class AcreConfig(PretrainedConfig):
    """Config of an ACRE model: the base config's fields + ``base_model_type`` + ``acre`` section."""

    model_type = "acre"

    def __init__(self, base_model_type: str = "qwen2", acre: dict | None = None, adapter_only: bool = False,
                 base_model_name_or_path: str | None = None, **kwargs: Any):
        self.base_model_type = base_model_type
        self.acre = dict(acre or {})
        self.adapter_only = bool(adapter_only)
        self.base_model_name_or_path = base_model_name_or_path
        super().__init__(**kwargs)

    @classmethod
    def from_base(cls, base_config: PretrainedConfig, acre: dict | None = None, **kwargs: Any) -> "AcreConfig":
        """Wrap a base (Llama-family) config; ``acre`` defaults to what ``attach_acre`` recorded."""
        check_supported(base_config)
        fields = {k: v for k, v in base_config.to_dict().items() if k not in _NOT_BASE_FIELDS}
        section = dict(getattr(base_config, "acre", None) or {})
        section.update(acre or {})
        return cls(base_model_type=base_config.model_type, acre=section, **fields, **kwargs)

    def to_base_config(self) -> PretrainedConfig:
        """The base architecture's own config class, rebuilt from the stored fields."""
        fields = {k: v for k, v in self.to_dict().items() if k not in _NOT_BASE_FIELDS}
        config = AutoConfig.for_model(self.base_model_type, **fields)
        config._attn_implementation = getattr(self, "_attn_implementation", None) or "sdpa"
        return config


class AcreForCausalLM(PreTrainedModel):
    """A Llama-family causal LM with ACRE L1 parameters attached.

    Plain calls (``model(input_ids)``) behave like the base model; ACRE inputs go through
    ``acre_forward`` (see ``adapter.py``), which this class supports because it exposes ``model``
    (the decoder) and ``lm_head`` like the base class does.
    """

    config_class = AcreConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    _supports_flex_attn = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AcreConfig, base: PreTrainedModel | None = None):
        super().__init__(config)
        if base is None:
            base = AutoModelForCausalLM.from_config(config.to_base_config())
            attach_from_section(base, config.acre)
        if next(base.parameters()).device.type != "meta":
            # Real weights are already initialised (L1 = copies of the base): post_init must not
            # re-initialise them. On the meta device (from_pretrained) transformers loads the weights
            # and initialises what is not stored (the rotary buffers).
            for module in base.modules():
                module._is_hf_initialized = True
        self.model = base.model
        self.lm_head = base.lm_head
        # The base wrapper is kept (not registered) for its forward; it shares the modules above.
        object.__setattr__(self, "_base", base)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any):
        return self._base.forward(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any):
        """Full exports load as usual; adapter-only exports load the base, then the L1 weights."""
        config = kwargs.get("config")
        if not isinstance(config, AcreConfig):
            config = AcreConfig.from_pretrained(pretrained_model_name_or_path)
        if not config.adapter_only:
            kwargs["config"] = config
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return cls._from_adapter(str(pretrained_model_name_or_path), config, kwargs)

    @classmethod
    def _from_adapter(cls, folder: str, config: AcreConfig, kwargs: dict) -> "AcreForCausalLM":
        from safetensors.torch import load_file

        if not os.path.isdir(folder):
            raise ValueError(f"adapter-only ACRE exports load from a local folder; got {folder!r}")
        base_ref = config.base_model_name_or_path
        if not base_ref:
            raise ValueError(f"{folder}: adapter-only export without base_model_name_or_path")
        local = os.path.join(folder, base_ref)
        if not os.path.isabs(base_ref) and os.path.isdir(local):
            base_ref = local  # a path relative to the export folder
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        base = AutoModelForCausalLM.from_pretrained(base_ref, trust_remote_code=False,
                                                     **({"dtype": dtype} if dtype is not None else {}))
        attach_from_section(base, config.acre)
        weights = os.path.join(folder, ADAPTER_WEIGHTS)
        try:
            state = load_file(weights)
        except Exception as exc:  # this file is copied into exports: no acre_train import here
            raise ValueError(f"{weights} is damaged or truncated ({type(exc).__name__}: {exc}); "
                             "export the adapter again") from exc
        own = next(base.parameters())
        load_acre_state_dict(base, {k: v.to(own.device, own.dtype) for k, v in state.items()})
        config._attn_implementation = base.config._attn_implementation
        model = cls(config, base=base)
        return model.eval()


AcreConfig.register_for_auto_class()
AcreForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def wrap(model: PreTrainedModel, **config_kwargs: Any) -> AcreForCausalLM:
    """An ``AcreForCausalLM`` sharing the modules of an ACRE model built with ``attach_acre``."""
    config = AcreConfig.from_base(model.config, **config_kwargs)
    config._attn_implementation = model.config._attn_implementation
    return AcreForCausalLM(config, base=model)
