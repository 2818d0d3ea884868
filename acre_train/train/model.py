"""Building the model a recipe trains: base source -> (ACRE adapter | vanilla) -> stage-1 weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..modeling import IGNORE_INDEX, acre_forward, acre_parameters, attach_acre, is_acre_model, load_acre_state_dict
from ..modeling.adapter import chunked_lm_loss
from .checkpoint import META, find_weights_checkpoint, load_trainable, read_meta
from .recipe_schema import Recipe
from .refill_loss import COLUMNS as REFILL_COLUMNS, QueryKeyCapture, learned_loss_sum, refill_loss_sum

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def base_reference(recipe: Recipe) -> dict[str, Any]:
    """What identifies the frozen base (stored in every checkpoint; stage 2 and export compare it)."""
    m = recipe.model
    ref: dict[str, Any] = {"source": m.source}
    if m.source.startswith("tiny:"):
        ref.update(tiny_config=dict(sorted(m.tiny_config.items())), tiny_seed=m.tiny_seed)
    return ref


def load_base(recipe: Recipe) -> nn.Module:
    """The base causal LM: ``tiny:<arch>`` built in-process, else ``from_pretrained`` (path, hub id or
    ``base:<name>`` of a fetched base)."""
    m = recipe.model
    if m.source.startswith("tiny:"):
        from ..tiny import tiny_model

        return tiny_model(m.source.partition(":")[2], seed=m.tiny_seed, attn_implementation=m.attn_implementation,
                          **m.tiny_config)
    from transformers import AutoModelForCausalLM

    from ..base.fetch import resolve_source

    return AutoModelForCausalLM.from_pretrained(resolve_source(m.source), dtype=DTYPES[m.dtype],
                                                attn_implementation=m.attn_implementation, trust_remote_code=False)


def build_model(recipe: Recipe) -> nn.Module:
    """The model with exactly the recipe's trainable parameters (and stage-1 L1 weights for stage 2)."""
    model = load_base(recipe)
    if recipe.mode == "acre":
        m = recipe.model
        attach_acre(model, train_o_proj=m.train_o_proj, lora=m.lora.model_dump() if m.l1 == "lora" else None)
    elif recipe.model.vanilla == "lora":
        model = vanilla_lora(model, recipe.model.lora.model_dump())
    else:
        model.requires_grad_(True)
    if recipe.model.init_from:
        load_initial_weights(model, recipe)
    if recipe.model.gradient_checkpointing:
        # Non-reentrant: a chunk's loss must reach earlier chunks' L1 keys/values (DESIGN §3).
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name goes in v6
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


VANILLA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj")


def vanilla_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    """The base with a peft LoRA on its own q/k/v projections (every base weight frozen): the SFT-vanilla
    control, trained on ACRE's data and steps with plain causal attention."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                        target_modules=list(VANILLA_LORA_TARGETS), bias="none")
    return get_peft_model(model, config)


def load_initial_weights(model: nn.Module, recipe: Recipe) -> Path:
    """Load a previous run's trainable weights (stage 2 from stage 1); the bases must match.

    ``model.init_from``: a run directory, a checkpoint directory, or an adapter-only ACRE export
    (``acre-train export --adapter-only``: a shared stage-1 adapter whose run is not on this machine).
    """
    path = Path(recipe.model.init_from)
    if (path / "config.json").is_file() and not (path / META).is_file():
        return _load_from_export(model, recipe, path)
    checkpoint = find_weights_checkpoint(path)
    meta = read_meta(checkpoint)
    theirs, ours = meta.get("base_model"), base_reference(recipe)
    if theirs != ours:
        raise ValueError(f"model.init_from {checkpoint} was trained on base {theirs}, this recipe uses {ours}")
    from ..modeling.learned_scorer import split_state

    weights, _scorer = split_state(load_trainable(checkpoint))  # a learned scorer starts afresh per run
    if is_acre_model(model):
        load_acre_state_dict(model, weights)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or len(weights) != sum(1 for _ in model.parameters()):
            raise ValueError(f"{checkpoint} does not hold this model's weights (unexpected: {unexpected[:4]})")
    return checkpoint


def _load_from_export(model: nn.Module, recipe: Recipe, folder: Path) -> Path:
    from ..base.fetch import resolve_source
    from ..files import read_safetensors
    from ..modeling.export_format import check_export_dir
    from ..modeling.hf import ADAPTER_WEIGHTS

    data = check_export_dir(folder)
    if not data.get("adapter_only"):
        raise ValueError(f"model.init_from {folder} is a full ACRE export; start from its run directory, or export "
                         "the run again with --adapter-only")
    if not is_acre_model(model):
        raise ValueError(f"model.init_from {folder} holds L1 weights; mode: vanilla cannot start from them")
    theirs, ours = data.get("base_model_name_or_path"), recipe.model.source
    if Path(resolve_source(str(theirs))).resolve() != Path(resolve_source(ours)).resolve():
        raise ValueError(f"model.init_from {folder} was exported for base {theirs}, this recipe uses {ours}")
    load_acre_state_dict(model, read_safetensors(folder / ADAPTER_WEIGHTS))
    return folder


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What checkpoints store: the L1 weights (ACRE) or every weight (vanilla)."""
    if is_acre_model(model):
        return {name: p.detach() for name, p in acre_parameters(model)}
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    if is_acre_model(model):
        load_acre_state_dict(model, state)
        return
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)


class LossModule(nn.Module):
    """``forward(**batch) -> (loss_sum, num_label_tokens)``: the one module DDP/DeepSpeed wrap.

    Wrapping the loss (not the bare model) makes the wrapper's forward run, which DDP needs for
    gradient sync, while ACRE still uses ``acre_forward`` (never a patched ``model.forward``).
    """

    def __init__(self, model: nn.Module, *, kernel: str | None = None, fused_ce: bool = False,
                 refill: dict[str, Any] | None = None, sim: Any = None, distill: dict[str, Any] | None = None):
        super().__init__()
        self.sim = sim  # refill_sim.SimSettings: stage 2 in the refilled layout
        # Distillation from the frozen base ({"weight", "temperature", "top_k", "stage"}; None or weight 0: off).
        self.distill = distill if distill and distill.get("weight") else None
        self.last_kl: tuple[float, int] = (0.0, 0)  # (KL sum, KL tokens) of the last forward, for the log
        self.model = model
        self.kernel = kernel
        self.fused_ce = fused_ce
        self.acre = is_acre_model(model)
        # Refill-aware stage 2 ({"layers", "temperature"}; None: off, the forward is untouched). With
        # {"params": "scorer", "scorer": ScorerSettings, "rank": r} the loss trains a learned scorer of
        # its own (``acre_scorer``, a submodule here so DDP/DeepSpeed sync and checkpoint it) instead.
        self.refill = refill
        self.scorer_settings = None
        self.scorer_only = False
        if refill is not None and refill.get("params") == "scorer":
            from ..modeling.learned_scorer import QueryMap

            self.scorer_settings = refill["scorer"]
            layers = self.scorer_settings.resolved_layers(model.config.num_hidden_layers)
            self.acre_scorer = QueryMap.for_model(model, layers, refill.get("rank", 8)).to(next(model.parameters()).device)
        # scorer_only: the L1 weights stay as loaded and only the learned scorer trains, so the forward
        # runs without gradients and stops after the last scoring layer (no answer loss is computed).
        self.scorer_only = bool(self.scorer_settings is not None and refill.get("scorer_only"))

    def forward(self, **batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(answer-loss sum, label tokens, refill-loss sum)``; the last is 0 unless the refill loss is on."""
        if "sim_scalars" in batch:
            from .refill_sim import sim_loss_sum

            loss_sum, count, kl = sim_loss_sum(self.model, batch, self.sim, kernel=self.kernel, distill=self.distill)
            loss_sum = self._mix(loss_sum, kl)
            # Every L1 weight takes part in every step (DDP/ZeRO reducers insist), even with no L1 token.
            loss_sum = loss_sum + 0.0 * sum(p.sum() for _, p in acre_parameters(self.model))
            return loss_sum, torch.as_tensor(count), loss_sum.new_zeros(())
        masks = {name: batch.pop(name) for name in REFILL_COLUMNS if name in batch}
        capture = None
        if self.refill is not None and masks:
            layers = self.scorer_settings.layers if self.scorer_settings is not None else self.refill["layers"]
            capture = QueryKeyCapture(layers, self.model.config.num_hidden_layers)
        if self.scorer_only:
            return self._scorer_only(batch, masks)
        if self.acre and self.fused_ce:
            loss_sum, count = self._acre_fused(**batch, capture=capture)
        elif self.acre:
            out = acre_forward(self.model, **batch, kernel=self.kernel, capture=capture)
            loss_sum, count = out.loss_sum, out.num_tokens
            if self.distill is not None:
                from .distill import batch_kl_sum

                d = self.distill
                kl = batch_kl_sum(self.model, batch, out.hidden_states, d["stage"], d["top_k"], d["temperature"])
                loss_sum = self._mix(loss_sum, kl)
        else:
            loss_sum, count = self._vanilla(**batch)
        if self.acre and not bool(batch["is_l1"].any()):
            # No L1 token: L1 weights take no part, which DDP/ZeRO reducers treat as an error.
            loss_sum = loss_sum + 0.0 * sum(p.sum() for _, p in acre_parameters(self.model))
        refill = loss_sum.new_zeros(())
        if capture is not None and self.scorer_settings is not None:
            refill = learned_loss_sum(self.model, capture, {**batch, **masks}, self.scorer_settings, self.acre_scorer)
        elif capture is not None:
            refill = refill_loss_sum(self.model, capture, {**batch, **masks}, self.refill["temperature"])
        return loss_sum, torch.as_tensor(count), refill

    def _mix(self, ce_sum: torch.Tensor, kl: tuple[torch.Tensor, int] | None) -> torch.Tensor:
        """``weight * KL + (1 - weight) * CE`` (sums over the batch's tokens); CE alone without distill."""
        if self.distill is None or kl is None:
            return ce_sum
        self.last_kl = (float(kl[0].detach()), kl[1])
        weight = self.distill["weight"]
        return weight * kl[0] + (1.0 - weight) * ce_sum

    def _scorer_only(self, batch: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]):
        """``(0, 0, refill-loss sum)``: a no-grad forward up to the last scoring layer, then the loss."""
        from .refill_loss import StopForward

        layers = self.scorer_settings.resolved_layers(self.model.config.num_hidden_layers)
        capture = QueryKeyCapture(layers, self.model.config.num_hidden_layers, stop_after_last=True)
        zero = self.acre_scorer.up[str(layers[0])].new_zeros(())
        if masks and bool(masks["refill_target"].any()):
            with torch.no_grad():
                try:
                    acre_forward(self.model, **{k: v for k, v in batch.items() if k != "labels"}, kernel=self.kernel,
                                 capture=capture)
                except StopForward:
                    pass
            return zero, torch.as_tensor(0), learned_loss_sum(self.model, capture, {**batch, **masks},
                                                               self.scorer_settings, self.acre_scorer)
        return zero, torch.as_tensor(0), zero + 0.0 * sum(p.sum() for p in self.acre_scorer.parameters())

    def _acre_fused(self, labels, capture=None, **batch):
        """Liger's fused linear + cross-entropy on the ACRE hidden states (CUDA only; see liger.py)."""
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        hidden = acre_forward(self.model, **batch, labels=None, kernel=self.kernel, capture=capture).hidden_states
        selected = labels != IGNORE_INDEX
        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        head = self.model.lm_head
        return loss_fn(head.weight, hidden[selected], labels[selected], getattr(head, "bias", None)), int(selected.sum())

    def _vanilla(self, input_ids, labels, attention_mask):
        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # a peft LoRA
        hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        selected = labels != IGNORE_INDEX
        return chunked_lm_loss(lm.lm_head, hidden[selected], labels[selected]), int(selected.sum())


def save_base(model_source: nn.Module, path: Path, recipe: Recipe) -> None:
    """Save a tiny base (no ACRE parameters) so later stages and exporters can load it by path."""
    path.mkdir(parents=True, exist_ok=True)
    model_source.save_pretrained(str(path))
    (path / "acre_base.json").write_text(json.dumps(base_reference(recipe), indent=2) + "\n", encoding="utf-8")
