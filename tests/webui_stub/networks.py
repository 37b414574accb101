"""``extensions-builtin/Lora/networks.py`` (A1111 1.5+'s built-in Lora), reduced to what the
extension meets: the WebUI imports it as the top-level module ``networks``.

As in A1111: ``load_networks`` (called by ``ExtraNetworkLora.activate`` with the job's
``<lora:name:te:unet>`` tags) fills ``loaded_networks``; nothing touches the weights then. Each
layer merges the loaded LoRAs into its own weight in its patched ``forward``
(``network_Linear_forward`` ... -> ``network_apply_weights``), keeping a backup it restores when
the set changes, and records what it carries in ``network_current_names``. The layer names are
A1111's (``assign_network_names_to_compvis_modules``: module paths with ``_``).

A stub LoRA file is a name in ``available_networks`` with a seed: its rank-2 deltas for every
``Linear`` of the UNet (``diffusion_model_*``: UNet strength) and of the text encoder
(``transformer_*``: text-encoder strength) are drawn from that seed.
"""

from __future__ import annotations

import torch
from modules import extra_networks, shared

available_networks: dict[str, int] = {}  # name -> seed
loaded_networks: list = []
originals: dict[str, object] = {}
RANK = 2


class NetworkModuleLora:
    def __init__(self, net, sd_key: str, up: torch.Tensor, down: torch.Tensor) -> None:
        self.network, self.sd_key, self.up, self.down = net, sd_key, up, down

    def multiplier(self) -> float:
        if "transformer" in self.sd_key[:20]:
            return self.network.te_multiplier
        return self.network.unet_multiplier

    def calc_updown(self, target):
        updown = (self.up @ self.down).to(target.device, target.dtype) * self.multiplier()
        return updown.reshape(target.shape), None


class Network:
    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.mentioned_name = name
        self.seed = seed
        self.te_multiplier = 1.0
        self.unet_multiplier = 1.0
        self.dyn_dim = None
        self.modules: dict[str, NetworkModuleLora] = {}
        self.bundle_embeddings: dict = {}


def assign_network_names_to_compvis_modules(sd_model) -> None:
    mapping = {}
    cond = getattr(sd_model, "cond_stage_model", None)
    if cond is not None:
        for name, module in getattr(cond, "wrapped", cond).named_modules():
            mapping[name.replace(".", "_")] = module
            module.network_layer_name = name.replace(".", "_")
    for name, module in sd_model.model.named_modules():
        mapping[name.replace(".", "_")] = module
        module.network_layer_name = name.replace(".", "_")
    sd_model.network_layer_mapping = mapping


def load_network(name: str, seed: int) -> Network:
    net = Network(name, seed)
    if not hasattr(shared.sd_model, "network_layer_mapping"):
        assign_network_names_to_compvis_modules(shared.sd_model)
    g = torch.Generator().manual_seed(seed)
    for key, module in sorted(shared.sd_model.network_layer_mapping.items()):
        if isinstance(module, torch.nn.Linear) and (key.startswith("diffusion_model") or key.startswith("transformer")):
            out_f, in_f = module.weight.shape
            up = torch.randn(out_f, RANK, generator=g) * 1.0
            down = torch.randn(RANK, in_f, generator=g) * 1.0
            net.modules[key] = NetworkModuleLora(net, key, up, down)
    return net


def load_networks(names, te_multipliers=None, unet_multipliers=None, dyn_dims=None) -> None:
    loaded_networks.clear()
    for i, name in enumerate(names):
        if name not in available_networks:
            print(f"Lora not found: {name}")
            continue
        net = load_network(name, available_networks[name])
        net.te_multiplier = te_multipliers[i] if te_multipliers else 1.0
        net.unet_multiplier = unet_multipliers[i] if unet_multipliers else 1.0
        net.dyn_dim = dyn_dims[i] if dyn_dims else 1.0
        loaded_networks.append(net)


def network_restore_weights_from_backup(self) -> None:
    weights_backup = getattr(self, "network_weights_backup", None)
    bias_backup = getattr(self, "network_bias_backup", None)
    if weights_backup is None and bias_backup is None:
        return
    if weights_backup is not None:
        self.weight.copy_(weights_backup)
    if bias_backup is not None:
        self.bias.copy_(bias_backup)


def network_apply_weights(self) -> None:
    """A1111's: restore from backup and merge the loaded networks when the wanted set changed."""
    network_layer_name = getattr(self, "network_layer_name", None)
    if network_layer_name is None:
        return
    current_names = getattr(self, "network_current_names", ())
    wanted_names = tuple((x.name, x.te_multiplier, x.unet_multiplier, x.dyn_dim) for x in loaded_networks)
    weights_backup = getattr(self, "network_weights_backup", None)
    if weights_backup is None and wanted_names != ():
        if current_names != ():
            raise RuntimeError("no backup weights found and current weights are not unchanged")
        weights_backup = self.weight.to("cpu", copy=True)
        self.network_weights_backup = weights_backup
    bias_backup = getattr(self, "network_bias_backup", None)
    if bias_backup is None:
        bias_backup = self.bias.to("cpu", copy=True) if getattr(self, "bias", None) is not None else None
        self.network_bias_backup = bias_backup
    if current_names != wanted_names:
        network_restore_weights_from_backup(self)
        for net in loaded_networks:
            module = net.modules.get(network_layer_name)
            if module is not None and hasattr(self, "weight"):
                with torch.no_grad():
                    updown, _ = module.calc_updown(self.weight)
                    self.weight.copy_((self.weight + updown).to(dtype=self.weight.dtype))
        self.network_current_names = wanted_names


def _patched(kind: str):
    def forward(self, input):
        network_apply_weights(self)
        return originals[kind](self, input)

    forward.__name__ = f"network_{kind}_forward"
    return forward


_LAYERS = {"Linear": torch.nn.Linear, "Conv2d": torch.nn.Conv2d, "GroupNorm": torch.nn.GroupNorm,
           "LayerNorm": torch.nn.LayerNorm}


def install() -> None:
    """``lora_patches.LoraPatches``: the layers' ``forward`` patched (what the Lora script does at start)."""
    for kind, cls in _LAYERS.items():
        if kind not in originals:
            originals[kind] = cls.forward
            cls.forward = _patched(kind)


def uninstall() -> None:
    for kind, cls in _LAYERS.items():
        if kind in originals:
            cls.forward = originals.pop(kind)


class ExtraNetworkLora(extra_networks.ExtraNetwork):
    """``extra_networks_lora.py``: the tags' arguments, read as A1111 reads them."""

    def __init__(self) -> None:
        super().__init__("lora")

    def activate(self, p, params_list) -> None:
        names, te_multipliers, unet_multipliers, dyn_dims = [], [], [], []
        for params in params_list:
            names.append(params.positional[0])
            te = float(params.positional[1]) if len(params.positional) > 1 else 1.0
            te = float(params.named.get("te", te))
            unet = float(params.positional[2]) if len(params.positional) > 2 else te
            unet = float(params.named.get("unet", unet))
            dyn = int(params.positional[3]) if len(params.positional) > 3 else None
            dyn = int(params.named["dyn"]) if "dyn" in params.named else dyn
            te_multipliers.append(te)
            unet_multipliers.append(unet)
            dyn_dims.append(dyn)
        load_networks(names, te_multipliers, unet_multipliers, dyn_dims)

    def deactivate(self, p) -> None:
        pass
