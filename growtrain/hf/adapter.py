"""Growable Hugging Face decoders: sites between decoder layers, zero-output layer insertion.

``growable(model)`` wraps a loaded ``transformers`` causal LM (GPT-2, GPT-NeoX/Pythia, Llama,
Mistral, Qwen2) *in place*: the wrapper holds the model as its submodule ``model`` and never
copies a weight. Its one growable stage, ``layers``, *is* the model's own ``nn.ModuleList`` of
decoder layers (``transformer.h``, ``gpt_neox.layers``, ``model.layers``), so an inserted layer
is a plain decoder layer of the model's own class and ``save_pretrained`` writes an ordinary
Hugging Face checkpoint.

Zero output. A new layer is built like the model builds its layers (the layer class, the
model's ``_init_weights``) and then its attention output projection and MLP down projection
(weights and biases) are zeroed. Every supported layer is ``z + W_a φ_a(z) + W_m φ_m(z)`` at
that point (sequential residual: the MLP sees ``norm(z + 0)``; parallel residual: it sees
``norm(z)``), so the layer is the identity and the logits do not change, bit for bit.

Consistency after an insertion (``sync``): ``config.num_hidden_layers`` (GPT-2: ``n_layer``)
is the number of layers (Llama's forward runs only ``layers[:num_hidden_layers]``), every
layer's ``layer_idx`` (the KV-cache slot) is its position, and per-layer lists such as
``config.layer_types`` follow the layers (a new layer takes the type of the layer it is
inserted in front of, or of the last layer at the end). Positions are handled by the model
(rotary embeddings or a learned table applied before the first layer), not by the layers.

The probe. A candidate (``HFCandidate``) is never run inside the model: the wrapper records
the keyword arguments its forward hands each decoder layer (attention mask, rotary
``position_embeddings``, ``position_ids``; never the KV cache), and ``probe_features(z)``
runs the candidate layer on the site's activation ``z`` with those arguments, keeping the
inputs of its two output projections, ``φ = [φ_a, 1, φ_m, 1]`` (ones where there are biases).
That is ``growtrain.families.base.DenseFeatures``: the joint one-pass probe of
``measure_saturation`` applies unchanged.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from growtrain.fsdp import unsharded_class
from growtrain.families.base import DenseFeatures
from growtrain.growable import GrowableMixin, Site

__all__ = ["DecoderSpec", "HFGrowable", "HFCandidate", "growable", "register_decoder", "DECODERS"]


@dataclass(frozen=True)
class DecoderSpec:
    """Where a causal-LM class keeps what growth needs (dotted attribute paths).

    Attributes:
        layers: the ``nn.ModuleList`` of decoder layers, from the causal-LM object.
        attn_out: the attention output projection inside one layer (``nn.Linear`` or GPT-2's ``Conv1D``).
        mlp_out: the MLP output projection inside one layer.
        layer_idx: attributes inside one layer that hold its position (the KV-cache slot).
        transposed: the projections store their weight as ``(in, out)`` (GPT-2's ``Conv1D``).
    """

    layers: str
    attn_out: str
    mlp_out: str
    layer_idx: tuple[str, ...]
    transposed: bool = False


_LLAMA = DecoderSpec("model.layers", "self_attn.o_proj", "mlp.down_proj", ("self_attn.layer_idx",))

# Causal-LM class name -> spec. Extend with ``register_decoder``.
DECODERS: dict[str, DecoderSpec] = {
    "GPT2LMHeadModel": DecoderSpec("transformer.h", "attn.c_proj", "mlp.c_proj", ("attn.layer_idx",), transposed=True),
    "GPTNeoXForCausalLM": DecoderSpec("gpt_neox.layers", "attention.dense", "mlp.dense_4h_to_h", ("attention.layer_idx",)),
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
}

# Keyword arguments of a decoder layer that carry the KV cache: never recorded for the probe.
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def register_decoder(class_name: str, spec: DecoderSpec) -> None:
    """Make another causal-LM class growable, e.g. one with Llama's layout under a new name::

        register_decoder("MyForCausalLM", DecoderSpec("model.layers", "self_attn.o_proj",
                                                      "mlp.down_proj", ("self_attn.layer_idx",)))

    The class's decoder layer must be ``z + attn_out(φ_a) + mlp_out(φ_m)`` with both
    projections linear (so zeroing them makes the layer the identity) and be constructible as
    ``LayerClass(config, layer_idx)``.
    """
    if not isinstance(spec, DecoderSpec):
        raise TypeError(f"spec: expected a growtrain.hf.DecoderSpec, got {type(spec).__name__}")
    DECODERS[str(class_name)] = spec


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: Any, path: str, value: Any) -> None:
    head, _, last = path.rpartition(".")
    setattr(_get(obj, head) if head else obj, last, value)


def _unsupported(model: nn.Module) -> TypeError:
    names = ", ".join(sorted(DECODERS))
    return TypeError(
        f"model: {type(model).__name__} is not a supported Hugging Face decoder; supported: {names}. "
        "To add one, register where its layers and output projections live, e.g. "
        "growtrain.hf.register_decoder('MyForCausalLM', growtrain.hf.DecoderSpec(layers='model.layers', "
        "attn_out='self_attn.o_proj', mlp_out='mlp.down_proj', layer_idx=('self_attn.layer_idx',))): "
        "`layers` names the nn.ModuleList of decoder layers, `attn_out`/`mlp_out` the attention and MLP output "
        "projections inside a layer, `layer_idx` the attributes that hold a layer's KV-cache position."
    )


def _refusal(model: nn.Module, allow_frozen: bool) -> str | None:
    """Why inserting a plain float layer into ``model`` would be wrong, or None."""
    config = getattr(model, "config", None)
    if getattr(model, "is_quantized", False) or getattr(config, "quantization_config", None) is not None:
        return (
            "it is quantized (config.quantization_config is set): a new layer would be a plain float layer among "
            "quantized ones, its zeros and its saved weights would not follow the quantization scheme, and "
            "save_pretrained would write a checkpoint its own quantization config cannot load. Load the model "
            "unquantized (dtype=torch.bfloat16 or float32) to grow it."
        )
    params = list(model.parameters())
    if any(not (p.is_floating_point()) for p in params):
        return "some weights are not floating point (packed or quantized tensors); load the model in a float dtype"
    if any(p.device.type == "meta" for p in params):
        return (
            "some weights are on the meta device (offloaded or not loaded, e.g. device_map with disk offload): "
            "a layer inserted next to them would not be dispatched; load the model fully onto one device"
        )
    if any(p.is_inference() for p in params):
        return (
            "its weights are inference tensors (the model was loaded under torch.inference_mode()), which autograd "
            "cannot differentiate: neither the probe nor training could use them; load it outside inference_mode"
        )
    if len({p.device for p in params}) > 1 or len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        return "it is split across devices (device_map); a new layer would not be placed or dispatched; use one device"
    if any("lora_" in name for name, _ in model.named_parameters()):
        return (
            "it carries LoRA/PEFT adapters: a new layer would have none, and the base weights the adapters assume "
            "are frozen; grow the base model first, then add adapters"
        )
    if params and not allow_frozen and not any(p.requires_grad for p in params):
        return (
            "every weight is frozen (requires_grad=False): an inserted layer's only purpose is to be trained, "
            "and with the rest frozen its zero output projections are all an optimizer could change. Unfreeze the "
            "model, or pass allow_frozen=True to grow a frozen model on purpose (new layers stay trainable)"
        )
    return None


class _TerminalParameters:
    """``layer.terminal_parameters()`` for a Hugging Face decoder layer: its ``V`` (attention and
    MLP output projections, each weight then bias), the contract ``growtrain.growable`` reads from
    every block, the existing ones too. A plain callable instance attribute, not a
    method or submodule: the layer keeps its class, its ``state_dict`` and ``save_pretrained``
    output; ``deepcopy`` maps ``layer`` to the copy."""

    def __init__(self, layer: nn.Module, paths: tuple[str, str]):
        self.layer, self.paths = layer, paths

    def __call__(self) -> list[nn.Parameter]:
        out = []
        for path in self.paths:
            proj = _get(self.layer, path)
            out.append(proj.weight)
            if getattr(proj, "bias", None) is not None:
                out.append(proj.bias)
        return out


def growable(model: nn.Module, *, allow_frozen: bool = False) -> "HFGrowable":
    """Wrap a loaded Hugging Face causal LM so that growtrain can measure and grow it.

    No weight is copied: ``growable(model).model is model``; growing the wrapper changes
    ``model`` itself (its decoder-layer list and config). Raises ``TypeError`` for an
    unsupported class (listing the supported ones and how to add one) and ``ValueError`` for a
    model where inserting a layer would be wrong (quantized, offloaded, inference tensors,
    PEFT adapters, or fully frozen unless ``allow_frozen``), before anything changes.
    """
    if isinstance(model, HFGrowable):
        return model
    return HFGrowable(model, allow_frozen=allow_frozen)


class HFGrowable(GrowableMixin, nn.Module):
    """A Hugging Face causal LM with growtrain's growth protocol; see the module docstring.

    ``forward(input_ids, attention_mask=None, **kwargs)`` returns the logits ``(B, T, V)``
    (a mapping with ``input_ids``/``attention_mask`` is accepted in place of ``input_ids``).
    ``generate`` and ``save_pretrained`` are the model's own.
    """

    growable_stages = ("layers",)

    def __init__(self, model: nn.Module, *, allow_frozen: bool = False):
        super().__init__()
        spec = DECODERS.get(type(model).__name__)
        if spec is None:
            raise _unsupported(model)
        reason = _refusal(model, allow_frozen)
        if reason is not None:
            raise ValueError(f"model: refusing to make {type(model).__name__} growable: {reason}")
        config = model.config
        if getattr(config, "is_heterogeneous", False):
            raise ValueError(
                "model: its config sets per-layer overrides (per_layer_config); an insertion would shift them to the "
                "wrong layers. Grow a model with one config for every layer."
            )
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise ValueError(
                "model: config.scale_attn_by_inverse_layer_idx is True, so each GPT-2 layer's attention scale depends on "
                "its position: moving layers down by an insertion would change them after save/load. Growth needs it False."
            )
        if getattr(config, "add_cross_attention", False):
            raise ValueError("model: it has cross-attention (config.add_cross_attention); only decoder-only models grow")
        self.model = model
        self.spec = spec
        layers = self.stage("layers")
        if len(layers) == 0:
            raise ValueError("model: it has no decoder layers; growth needs at least one to copy the layer class from")
        types = getattr(config, "layer_types", None)
        for i, layer in enumerate(layers):
            # The layer's own attention type travels with it when later insertions shift it.
            layer._growtrain_layer_type = types[i] if types is not None else None
            self._mark(layer)
        self._init_growth()
        self.training = model.training  # the wrapper adds no module of its own: it is in the model's mode
        # Per decoder-layer index: the arguments after the hidden states (by name) that the last
        # forward gave that layer, KV cache removed. Plain attribute: no state_dict entry.
        object.__setattr__(self, "_layer_calls", {})

    # -- growth protocol -----------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    def stage(self, name: str) -> nn.ModuleList:
        if name != "layers":
            raise ValueError(f"stage: a Hugging Face decoder has one growable stage, 'layers'; got {name!r}")
        return _get(self.model, self.spec.layers)

    def first_site(self, stage: str) -> int:
        return 0  # a decoder layer keeps the shape, so "before the first layer" fits too

    def make_block(self, stage: str) -> nn.Module:  # pragma: no cover - new_block needs the site
        raise NotImplementedError("HFGrowable builds candidates per site: call new_block(site)")

    def new_block(self, site: Site | str, seed: int | None = None) -> "HFCandidate":
        """A zero-output candidate decoder layer for ``site`` (on the model's device and dtype)."""
        site = self.site(site)
        # Built on the CPU (the seeded stream is the CPU generator), then moved: a candidate is
        # the same for a seed on every device.
        with torch.device("cpu"):
            if seed is None:
                layer = self._build_layer(site.index)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(seed))
                    layer = self._build_layer(site.index)
        ref = self.neighbour_tensor(site)
        return HFCandidate(layer.to(device=ref.device, dtype=ref.dtype), self, site.index)

    def _build_layer(self, index: int) -> nn.Module:
        layers = self.stage("layers")
        neighbour = min(index, len(layers) - 1)
        layer_type = getattr(layers[neighbour], "_growtrain_layer_type", None)
        config = self.config
        types = getattr(config, "layer_types", None)
        # Constructors read config.layer_types[layer_idx] (e.g. Qwen2's sliding window): build at
        # the neighbour's index so the new layer gets the neighbour's type, then renumber.
        if types is not None and len(types) != len(layers):
            self.sync()
        layer = unsharded_class(layers[neighbour])(config, neighbour)
        for module in layer.modules():
            self.model._init_weights(module)
        layer._growtrain_layer_type = layer_type
        self._mark(layer)
        _zero(self._terminal(layer))
        for path in self.spec.layer_idx:
            _set(layer, path, index)
        return layer

    def _mark(self, layer: nn.Module) -> None:
        layer.terminal_parameters = _TerminalParameters(layer, (self.spec.attn_out, self.spec.mlp_out))

    def _terminal(self, layer: nn.Module) -> list[nn.Parameter]:
        return _TerminalParameters(layer, (self.spec.attn_out, self.spec.mlp_out))()

    def grow(self, site: Site | str, block: nn.Module | None = None) -> nn.Module:
        """Insert a zero-output decoder layer at ``site`` and return the inserted layer.

        ``block``: a candidate from ``new_block`` (its layer is inserted) or a decoder layer of
        the model's own class with zero output projections; ``None`` builds a fresh one. Every
        check runs before the model changes.
        """
        site = self.site(site)
        layers = self.stage("layers")
        if block is None:
            block = self.new_block(site)
        layer = block.layer if isinstance(block, HFCandidate) else block
        layer_class = unsharded_class(layers[0])  # FSDP2 swaps a sharded layer's class for FSDP<Class>
        if unsharded_class(layer) is not layer_class:
            raise TypeError(
                f"block: expected a growtrain.hf candidate or a {layer_class.__name__} (the model's own layer "
                f"class), got {type(block).__name__}"
            )
        if any(layer is m for m in self.modules()):
            raise ValueError("block: this layer is already part of the model; pass a fresh block")
        ref = self.neighbour_tensor(site)
        layer = layer.to(device=ref.device, dtype=ref.dtype)
        nonzero = [tuple(p.shape) for p in self._terminal(layer) if bool(torch.any(p.detach() != 0))]
        if nonzero:
            raise ValueError(
                f"block: its output projections ({self.spec.attn_out}, {self.spec.mlp_out}) must be exactly zero "
                f"(function-preserving insertion), but tensors of shape {nonzero} are not"
            )
        if not hasattr(layer, "_growtrain_layer_type"):
            neighbour = layers[min(site.index, len(layers) - 1)]
            layer._growtrain_layer_type = getattr(neighbour, "_growtrain_layer_type", None)
        self._mark(layer)
        layer.train(layers[min(site.index, len(layers) - 1)].training)  # the neighbours' mode, e.g. eval
        layers.insert(site.index, layer)
        self.sync()
        self.growth_log.append({"site": site.name, "stage": site.stage, "index": site.index})
        self._grown_blocks.append(layer)
        return layer

    def undo_growth(self, blocks, log_len: int) -> None:
        """Take insertions back out (``GrowableMixin.undo_growth``), then re-sync the config and
        every layer's KV-cache index, so the raw model is consistent at once."""
        super().undo_growth(blocks, log_len)
        self.sync()

    def sync(self) -> None:
        """Make the config and every layer's position agree with the layer list (after growth,
        or after an insertion was undone by removing a layer from the list)."""
        layers = self.stage("layers")
        config = self.config
        for i, layer in enumerate(layers):
            for path in self.spec.layer_idx:
                _set(layer, path, i)
            if hasattr(layer, "layer_idx"):
                layer.layer_idx = i
        config.num_hidden_layers = len(layers)  # GPT-2 maps it to n_layer
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [layer._growtrain_layer_type for layer in layers]

    def terminal_parameters_of(self, layer: nn.Module) -> list[nn.Parameter]:
        """``V`` of a decoder layer: attention and MLP output projections (weights, then biases)."""
        return self._terminal(layer)

    # -- forward -------------------------------------------------------------------------
    def forward(self, input_ids: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if isinstance(input_ids, Mapping):
            kwargs = {**input_ids, **kwargs}
            input_ids = kwargs.pop("input_ids", None)
            attention_mask = kwargs.pop("attention_mask", attention_mask)
        layers = self.stage("layers")
        if self.config.num_hidden_layers != len(layers):
            self.sync()
        calls = self._layer_calls
        calls.clear()
        handles = [
            layer.register_forward_pre_hook(self._recorder(i), with_kwargs=True) for i, layer in enumerate(layers)
        ]
        try:
            kwargs.setdefault("use_cache", False)  # training and the probe need no KV cache
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            for h in handles:
                h.remove()
        return out.logits

    def _recorder(self, index: int):
        def record(module, args, kwargs):
            bound = _signature(type(module)).bind_partial(module, None, *args[1:], **kwargs).arguments
            bound.pop(next(iter(bound)))  # self
            bound.pop(next(iter(bound)))  # the hidden states: the probe supplies its own
            for name in _CACHE_ARGS:
                if name in bound:
                    bound[name] = None
            if "use_cache" in bound:
                bound["use_cache"] = False
            self._layer_calls[index] = bound

        return record

    def layer_call(self, index: int) -> dict:
        """The keyword arguments the last forward gave decoder layer ``index`` (the last layer
        for the end site), for running a candidate at that position."""
        layers = self.stage("layers")
        index = min(index, len(layers) - 1)
        if index not in self._layer_calls:
            raise RuntimeError(
                "probe: no forward through this wrapper has run yet, so the decoder layers' attention mask and "
                "position embeddings are unknown; call the wrapper (not the inner model) on the probe batch first"
            )
        return dict(self._layer_calls[index])

    def generate(self, *args: Any, **kwargs: Any):
        if self.config.num_hidden_layers != len(self.stage("layers")):
            self.sync()
        return self.model.generate(*args, **kwargs)

    def save_pretrained(self, *args: Any, **kwargs: Any):
        """The model's own ``save_pretrained``: a plain Hugging Face checkpoint at the grown depth."""
        self.sync()
        return self.model.save_pretrained(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _signature(layer_class: type) -> inspect.Signature:
    # Read once per layer class: the recorder runs on every layer of every forward.
    return inspect.signature(layer_class.forward)


def _zero(params: list[nn.Parameter]) -> None:
    with torch.no_grad():
        for p in params:
            p.zero_()


class HFCandidate(nn.Module):
    """A candidate decoder layer for one site: the probe's view of it (``terminal_parameters``,
    ``probe_features``, ``split_terminal``). ``HFGrowable.grow`` inserts its ``layer``."""

    def __init__(self, layer: nn.Module, owner: HFGrowable, index: int):
        super().__init__()
        self.layer = layer
        # Not a submodule: the candidate's parameters are the layer's only.
        object.__setattr__(self, "_owner", owner)
        self.index = index

    def terminal_parameters(self) -> list[nn.Parameter]:
        return self._owner.terminal_parameters_of(self.layer)

    def zero_init_last(self) -> None:
        _zero(self.terminal_parameters())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The layer at this site on activation ``z`` with the last forward's mask and positions."""
        return self.layer(z, **self._owner.layer_call(self.index))

    def projections(self) -> list[nn.Module]:
        spec = self._owner.spec
        return [_get(self.layer, spec.attn_out), _get(self.layer, spec.mlp_out)]

    def probe_features(self, z: torch.Tensor) -> DenseFeatures:
        """``[φ_a, 1, φ_m, 1]`` per token (ones only for projections with a bias): ``(B, T, K)``."""
        inputs: list[torch.Tensor | None] = [None, None]

        def keep(k):
            def hook(module, args):
                inputs[k] = args[0]

            return hook

        projections = self.projections()
        handles = [p.register_forward_pre_hook(keep(k)) for k, p in enumerate(projections)]
        try:
            self(z)
        finally:
            for h in handles:
                h.remove()
        parts = []
        for proj, phi in zip(projections, inputs):
            parts.append(phi)
            if getattr(proj, "bias", None) is not None:
                parts.append(phi.new_ones(phi.shape[:-1] + (1,)))
        return DenseFeatures(torch.cat(parts, dim=-1), bias=False)

    def split_terminal(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """``(C, K)`` cross-gradient matrix → tensors shaped like ``terminal_parameters()``."""
        transposed = self._owner.spec.transposed
        widths, kinds = [], []
        for proj in self.projections():
            fan_in = proj.weight.shape[0] if transposed else proj.weight.shape[1]
            widths.append(fan_in)
            kinds.append("w")
            if getattr(proj, "bias", None) is not None:
                widths.append(1)
                kinds.append("b")
        if matrix.shape[-1] != sum(widths):
            raise ValueError(f"matrix: expected {sum(widths)} columns (this layer's features), got {tuple(matrix.shape)}")
        out = []
        for part, kind in zip(matrix.split(widths, dim=-1), kinds):
            if kind == "b":
                out.append(part.squeeze(-1))
            else:
                out.append(part.t() if transposed else part)
        return out
