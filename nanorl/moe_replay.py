"""MoE routing replay (R3): the trainer routes each token to the experts the rollout engine used.

In a mixture-of-experts model every token picks its top-k experts from router logits; rollout engine and
trainer compute those with different kernels, batch shapes and dtypes, so near-ties flip, the importance
ratio measures a different network, and runs collapse. Routing replay (R3, Ma et al. 2025,
arXiv:2510.11370) records the expert ids each token used at rollout (link 1 of the chain) and makes every
training forward (links 3 and 6: logprob recompute, backward) dispatch to exactly those; only the
selection is frozen, the gates come from the current router logits (so the router still learns).
Start at `record` and `replay` (context managers around generation and forwards), `patch` (wraps each
router's forward) and `checkpoint_context` (for activation checkpointing). Key choices: each patched
router reads its own layer index of the replay (indexing, not cursors), one table row per architecture
(`_ARCHS`), ids stored as uint8/int16. The formula, where it hooks into the chain, and slime's cursors:
docs/from-slime-verl.md, "nanorl/moe_replay.py".

Test: python -m pytest tests/test_moe_replay.py -q
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------ architectures (one row each)
@dataclass(frozen=True)
class _Arch:
    # divide the k gates by their sum?
    renormalise: Callable[[torch.nn.Module], bool]
    # gates returned in the logits' dtype (else fp32)
    cast_to_logits_dtype: bool


_ARCHS: dict[str, _Arch] = {
    # transformers/models/qwen3_moe: softmax(fp32) -> topk -> renorm iff norm_topk_prob -> logits dtype
    "Qwen3MoeTopKRouter": _Arch(lambda r: bool(r.norm_topk_prob), True),
    # transformers/models/qwen2_moe: identical router (the shared expert lives outside it)
    "Qwen2MoeTopKRouter": _Arch(lambda r: bool(r.norm_topk_prob), True),
    # transformers/models/mixtral: softmax(fp32) -> topk -> always renorm, gates stay fp32
    "MixtralTopKRouter": _Arch(lambda r: True, False),
}
SUPPORTED_ROUTERS = tuple(_ARCHS)


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in _ARCHS]


def is_moe(model: torch.nn.Module) -> bool:
    """True if the model routes tokens to experts (supported router found, or its config says so)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0) or 0
    return bool(_routers(model)) or n > 0


# ------------------------------------------------------------------ per-model state
# every patched model's state, for checkpoint_context
_STATES: "weakref.WeakSet[_State]" = weakref.WeakSet()
# recompute override meaning "the checkpointed forward routed naturally"
_NATURAL = object()


class _State:
    """Shared by the routers of one patched model: which mode is in force."""

    def __init__(self, n_layers: int, top_k: int, n_experts: int):
        self.n_layers, self.top_k, self.n_experts = n_layers, top_k, n_experts
        # Recording | Replay | None, set by the context managers
        self.active = None
        # set by checkpoint_context during a recompute
        self.override = None
        # safety net, see _routed_forward
        self.last_grad_forward_replayed = False
        _STATES.add(self)

    # deepcopy(model) (e.g. a reference model) gets a fresh, idle state
    def __setstate__(self, d):
        self.__dict__.update(d)
        self.active, self.override = None, None
        _STATES.add(self)


def _state(model: torch.nn.Module) -> _State:
    routers = [r for r in _routers(model) if hasattr(r, "_nanorl_state")]
    if not routers:
        raise ValueError("model is not patched for routing replay: call moe_replay.patch(model) first")
    return routers[0]._nanorl_state


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every supported router of `model` (idempotent). Returns the model.

    Raises ValueError for an MoE whose router class has no row in _ARCHS (it would silently not replay).
    """
    routers = _routers(model)
    if not routers:
        found = sorted({type(m).__name__ for m in model.modules() if "router" in type(m).__name__.lower()})
        raise ValueError(f"no supported MoE router in {type(model).__name__} (supported: "
                         f"{', '.join(SUPPORTED_ROUTERS)}; router-like modules found: {found or 'none'})")
    if hasattr(routers[0], "_nanorl_state"):
        return model
    ks = {int(r.top_k) for r in routers}
    es = {int(r.num_experts) for r in routers}
    if len(ks) != 1 or len(es) != 1:
        raise ValueError(f"routers disagree on top_k {ks} / num_experts {es}; [B, S, L, k] needs one k")
    state = _State(len(routers), ks.pop(), es.pop())
    for layer, router in enumerate(routers):
        router._nanorl_state = state
        router._nanorl_layer = layer
        # A bound method as instance attribute: nn.Module.__call__ (and its hooks) use it, and
        # deepcopy re-binds it to the copied router.
        router.forward = _routed_forward.__get__(router)
    return model


def _routed_forward(self, hidden_states: torch.Tensor):
    st: _State = self._nanorl_state
    target = st.override if st.override is not None else st.active
    # inside autograd: a checkpoint recompute
    in_backward = torch._C._current_graph_task_id() != -1
    if torch.is_grad_enabled() and not in_backward:
        st.last_grad_forward_replayed = isinstance(target, Replay)
    if target is None or target is _NATURAL:
        if target is None and in_backward and st.last_grad_forward_replayed:
            # The recompute would route naturally although the forward replayed: wrong gradients.
            raise RuntimeError("activation-checkpoint recompute of a replayed MoE forward outside the replay "
                               "context: pass context_fn=nanorl.moe_replay.checkpoint_context to checkpoint")
        return type(self).forward(self, hidden_states)
    if isinstance(target, Recording):
        out = type(self).forward(self, hidden_states)
        # a recompute must not append the same tokens twice
        if st.override is None:
            target._append(self._nanorl_layer, out[2])
        return out
    return _replayed_route(self, hidden_states, target)


def _replayed_route(router, hidden_states: torch.Tensor, rep: "Replay"):
    """The router's own formula with topk replaced by the recorded ids (docs/from-slime-verl.md)."""
    arch = _ARCHS[type(router).__name__]
    h = hidden_states.reshape(-1, router.hidden_dim)                # [N, H]
    logits = F.linear(h, router.weight)                             # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)      # [N, E] over ALL experts
    natural = torch.topk(probs, router.top_k, dim=-1).indices       # [N, k] what it would pick
    ids, keep = rep._ids(router._nanorl_layer, h.shape[0], h.device)  # [N, k], [N] | None
    if keep is not None:
        # mask False -> route naturally
        ids = torch.where(keep[:, None], ids, natural)
    rep._note_natural(router._nanorl_layer, natural)
    gates = probs.gather(-1, ids)                                   # [N, k] current probs, fixed ids
    if arch.renormalise(router):
        gates = gates / gates.sum(dim=-1, keepdim=True)
    if arch.cast_to_logits_dtype:
        gates = gates.to(logits.dtype)
    return logits, gates, ids


def _compact_dtype(n_experts: int) -> torch.dtype:
    return torch.uint8 if n_experts <= 256 else torch.int16


# ------------------------------------------------------------------ record
class Recording:
    """Expert ids chosen by each forward inside `record(model)`.

    `experts` -> [B, S, L, k] compact ids on CPU; successive forwards (prefill, then one-token decode
    steps with a KV cache) are concatenated along S, so column s holds the routing of the s-th token
    fed to the model. Batch size must stay constant across the forwards.
    """

    def __init__(self, state: _State):
        self.n_layers, self.top_k = state.n_layers, state.top_k
        self.dtype = _compact_dtype(state.n_experts)
        # per forward: per layer [B, s, k]
        self._steps: list[list[torch.Tensor | None]] = []
        self._shape: tuple[int, int] | None = None          # [B, s] of the forward in progress
        self._cache: torch.Tensor | None = None

    def _begin(self, batch: int, seq: int) -> None:
        self._steps.append([None] * self.n_layers)
        self._shape = (batch, seq)

    def _append(self, layer: int, ids: torch.Tensor) -> None:
        if self._shape is None:
            raise RuntimeError("router ran without a model forward: record(model) hooks model.base_model")
        b, s = self._shape
        if ids.shape[0] != b * s:
            raise ValueError(f"layer {layer} routed {ids.shape[0]} tokens, the forward's input is [{b}, {s}]")
        # Stays on the device (no sync per layer) but already compact; moved to CPU when read.
        self._steps[-1][layer] = ids.detach().to(self.dtype).reshape(b, s, self.top_k)  # [B, s, k]
        self._cache = None

    @property
    def experts(self) -> torch.Tensor:
        if self._cache is None:
            if not self._steps:
                raise ValueError("nothing was recorded: no forward ran inside record(model)")
            steps = [torch.stack(st, dim=2) for st in self._steps if all(t is not None for t in st)]
            if len(steps) != len(self._steps):
                raise RuntimeError("a recorded forward did not route through every MoE layer")
            if len({t.shape[0] for t in steps}) != 1:
                raise ValueError("batch size changed between recorded forwards; cannot concatenate along S")
            self._cache = torch.cat(steps, dim=1).cpu()  # [B, S, L, k]
        return self._cache


@contextlib.contextmanager
def record(model: torch.nn.Module):
    """Record routing of every forward of `model` (patched) inside the block. Yields a Recording."""
    st = _state(model)
    if st.active is not None:
        raise RuntimeError("record/replay contexts do not nest on one model")
    rec = Recording(st)

    def hook(_module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs.get("inputs_embeds")
        if x is None:
            raise ValueError("record(model): forward got neither input_ids nor inputs_embeds")
        rec._begin(int(x.shape[0]), int(x.shape[1]))

    handle = getattr(model, "base_model", model).register_forward_pre_hook(hook, with_kwargs=True)
    st.active = rec
    try:
        yield rec
    finally:
        st.active = None
        handle.remove()
    rec.experts  # noqa: B018 — materialise on CPU now, freeing the device copies
    rec._steps = []


# ------------------------------------------------------------------ replay
class Replay:
    """Recorded ids in force inside `replay(...)`. After a forward, `natural_experts` [B, S, L, k] holds
    the experts the current router WOULD have picked (for the routing-disagreement metric)."""

    def __init__(self, state: _State, experts: torch.Tensor, mask: torch.Tensor | None):
        if experts.dim() != 4 or experts.shape[2] != state.n_layers or experts.shape[3] != state.top_k:
            raise ValueError(f"experts must be [B, S, L={state.n_layers}, k={state.top_k}], got "
                             f"{tuple(experts.shape)}")
        if experts.dtype.is_floating_point or experts.dtype == torch.bool:
            raise ValueError(f"experts must hold integer ids, got {experts.dtype}")
        if mask is not None and (mask.shape != experts.shape[:2]):
            raise ValueError(f"mask must be [B, S] = {tuple(experts.shape[:2])}, got {tuple(mask.shape)}")
        used = experts if mask is None else experts[mask.bool()]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= state.n_experts):
            raise ValueError(f"expert ids outside [0, {state.n_experts}) where the mask is True")
        self.batch, self.seq = int(experts.shape[0]), int(experts.shape[1])
        self._experts, self._mask = experts, mask
        self._dev: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._natural: list[torch.Tensor | None] = [None] * state.n_layers
        self._n_experts = state.n_experts

    def _ids(self, layer: int, n_tokens: int, device: torch.device):
        if n_tokens != self.batch * self.seq:
            raise ValueError(f"replay holds ids for [B={self.batch}, S={self.seq}] but layer {layer} routed "
                             f"{n_tokens} tokens: replay needs a forward over the same input (no KV decode)")
        # one transfer per device, kept compact (a long copy of all L
        if device not in self._dev:
            # layers would be 8x larger); ids outside the mask may wrap, they are never dispatched
            mask = None if self._mask is None else self._mask.to(device=device, dtype=torch.bool)
            self._dev[device] = (self._experts.to(device=device, dtype=_compact_dtype(self._n_experts)), mask)
        experts, mask = self._dev[device]
        ids = experts[:, :, layer].reshape(n_tokens, -1).long()            # [N, k]
        return ids, (None if mask is None else mask.reshape(n_tokens))     # [N]

    def _note_natural(self, layer: int, natural: torch.Tensor) -> None:
        # A slot per layer, overwritten by each forward/recompute of this batch: nothing accumulates.
        self._natural[layer] = natural.detach().to(_compact_dtype(self._n_experts))

    @property
    def natural_experts(self) -> torch.Tensor:
        if any(t is None for t in self._natural):
            raise ValueError("no forward has run inside this replay yet")
        stacked = torch.stack([t.reshape(self.batch, self.seq, -1) for t in self._natural], dim=2)
        return stacked.cpu()  # [B, S, L, k]


@contextlib.contextmanager
def replay(model: torch.nn.Module, experts: torch.Tensor, mask: torch.Tensor | None = None):
    """Dispatch every forward of `model` (patched) inside the block to recorded experts.

    experts: [B, S, L, k] integer ids aligned with the forward's input_ids [B, S] (any int dtype).
    mask:    [B, S] bool or None; False -> that token routes naturally (padding, unrecorded tokens).
    Gates are the architecture's normalisation of the CURRENT router logits at those ids, so the
    router is trained. Yields the Replay (see Replay.natural_experts).
    """
    st = _state(model)
    if st.active is not None:
        raise RuntimeError("record/replay contexts do not nest on one model")
    rep = Replay(st, experts, mask)
    st.active = rep
    try:
        yield rep
    finally:
        st.active = None


def checkpoint_context():
    """`context_fn` for torch.utils.checkpoint(use_reentrant=False): replay-backward.

    Called when the checkpointed forward runs; snapshots each patched model's mode then (a Replay, a
    Recording, or natural) and returns (forward ctx, recompute ctx); the recompute ctx re-installs the
    snapshot while the backward re-runs the region, so it dispatches to the same ids even after the
    `with replay(...)` block has exited, and a Recording is not appended to twice.
    """
    snapshot = {st: (st.active if st.active is not None else _NATURAL) for st in list(_STATES)}

    @contextlib.contextmanager
    def recompute():
        saved = {st: st.override for st in snapshot}
        for st, mode in snapshot.items():
            st.override = mode
        try:
            yield
        finally:
            for st, old in saved.items():
                st.override = old

    return contextlib.nullcontext(), recompute()


# ------------------------------------------------------------------ metric
def routing_disagreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Share of (token, layer) pairs whose expert SET differs between a and b.

    a, b: [..., L, k] expert ids (e.g. [B, S, L, k] or one sample's [n, L, k]); order within k ignored.
    mask: [...] bool/0-1 (e.g. [B, S] routed_mask), None = all tokens. Returns 0.0 if nothing is valid.
    """
    if a.shape != b.shape or a.dim() < 2:
        raise ValueError(f"routing_disagreement needs equal [..., L, k] shapes, got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    differ, valid = _differ(a, b, mask)                                                    # [..., L] each
    n = int(valid.sum())
    return float((differ & valid).sum()) / n if n else 0.0


def routing_disagreement_by_layer(a: torch.Tensor, b: torch.Tensor,
                                  mask: torch.Tensor | None = None) -> list[float]:
    """routing_disagreement per MoE layer: [share for layer 0, 1, ..., L-1] (logged as
    routing/disagreement/layer_<i>: a mismatch that sits in a few layers points at those layers)."""
    if a.shape != b.shape or a.dim() < 2:
        raise ValueError("routing_disagreement_by_layer needs equal [..., L, k] shapes, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    differ, valid = _differ(a, b, mask)                                                    # [..., L] each
    L = differ.shape[-1]
    hits = (differ & valid).reshape(-1, L).sum(0)                                          # [L]
    n = valid.reshape(-1, L).sum(0)                                                        # [L]
    return [float(h) / int(c) if c else 0.0 for h, c in zip(hits.tolist(), n.tolist())]


def _differ(a, b, mask):
    """([..., L] bool: the expert sets differ, [..., L] bool: the token is valid)."""
    differ = (a.long().sort(dim=-1).values != b.long().sort(dim=-1).values).any(dim=-1)  # [..., L]
    if mask is None:
        return differ, torch.ones_like(differ)
    if mask.shape != a.shape[:-2]:
        raise ValueError(f"mask must be {tuple(a.shape[:-2])}, got {tuple(mask.shape)}")
    return differ, mask.bool().to(differ.device)[..., None].expand_as(differ)


# ------------------------------------------------------------------ tiny models for tests / CPU runs
def tiny_moe(arch: str = "qwen3_moe", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny randomly initialised HF MoE causal LM built in code (no download), not yet patched.

    arch: "qwen3_moe" | "mixtral" | "qwen2_moe". Defaults: vocab 32, hidden 32, 2 layers, 4 heads
    (2 KV), 8 experts, top-2, initializer_range 0.1 (0.02 makes routing near-uniform and expert
    outputs negligible). `overrides` go to the config (e.g. vocab_size=23). Init RNG is local to `seed`.
    """
    # lazy: the replay machinery itself needs only torch
    import transformers

    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
                  max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        cfg_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        extra = dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
    elif arch == "qwen2_moe":
        cfg_cls, model_cls = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
        extra = dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     norm_topk_prob=False)
        common.pop("head_dim")
    elif arch == "mixtral":
        cfg_cls, model_cls = transformers.MixtralConfig, transformers.MixtralForCausalLM
        extra = dict(num_local_experts=8, router_jitter_noise=0.0)
    else:
        raise ValueError(f"unknown tiny MoE arch {arch!r}: use 'qwen3_moe', 'mixtral' or 'qwen2_moe'")
    config = cfg_cls(**{**common, **extra, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config)
