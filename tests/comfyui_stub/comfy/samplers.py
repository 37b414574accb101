"""``comfy.samplers``: the CFGGuider (OUTER_SAMPLE wrappers around ``outer_sample``; wrappers and
patches of the ModelPatcher copied into ``transformer_options``; cond and uncond in one batch) and
an Euler sampler over ComfyUI's discrete-EPS sigmas."""

from __future__ import annotations

import copy

import torch

from comfy import model_management, patcher_extension


class CFGGuider:
    def __init__(self, model_patcher):
        self.model_patcher = model_patcher
        self.model_options = model_patcher.model_options
        self.original_conds = {}
        self.cfg = 1.0

    def set_conds(self, positive, negative):
        self.original_conds = {"positive": positive, "negative": negative}

    def set_cfg(self, cfg):
        self.cfg = cfg

    def calc_cond_batch(self, x, sigma):
        conds = [self.conds["positive"][0], self.conds["negative"][0]]
        context = torch.cat([c["cross_attn"] for c in conds])
        control = conds[0].get("control")
        to = copy.copy(self.model_options["transformer_options"])
        to["cond_or_uncond"] = [0, 1]
        to["sigmas"] = sigma
        batch = torch.cat([x, x])
        sig = torch.cat([sigma, sigma])
        c = {"c_crossattn": context, "transformer_options": to}
        model = self.inner_model
        extras = [model.extra_conds(**{k: v for k, v in cond.items() if k not in ("cross_attn", "control")})
                  for cond in conds]
        def rows(t):  # CONDRegular: each cond's value repeated to its rows, the conds concatenated
            return t.repeat((x.shape[0],) + (1,) * (t.ndim - 1))

        for key in extras[0]:
            if torch.is_tensor(extras[0][key]):
                c[key] = torch.cat([rows(e[key]) for e in extras])
            elif isinstance(extras[0][key], list):  # CONDList: item by item
                c[key] = [torch.cat([rows(e[key][i]) for e in extras]) for i in range(len(extras[0][key]))]
            else:
                c[key] = extras[0][key]
        if control is not None:
            c["control"] = control.get_control(batch, sig, c, len(conds))
        if "model_function_wrapper" in self.model_options:
            out = self.model_options["model_function_wrapper"](
                model.apply_model, {"input": batch, "timestep": sig, "c": c, "cond_or_uncond": [0, 1]})
        else:
            out = model.apply_model(batch, sig, **c)
        cond, uncond = out.chunk(2)
        return uncond + (cond - uncond) * self.cfg

    def inner_sample(self, noise, sigmas, callback=None):
        x = noise * sigmas[0]
        for i in range(len(sigmas) - 1):
            model_management.throw_exception_if_processing_interrupted()
            s = sigmas[i] * x.new_ones([x.shape[0]])
            denoised = self.calc_cond_batch(x, s)
            d = (x - denoised) / sigmas[i]
            x = x + d * (sigmas[i + 1] - sigmas[i])
        return x

    def outer_sample(self, noise, sigmas, callback=None):
        model_management.load_models_gpu([self.model_patcher])
        self.inner_model = self.model_patcher.model
        for name, obj in self.model_patcher.object_patches.items():  # patch_model's object patches
            setattr(self.inner_model, name.split(".")[-1], obj)
        return self.inner_sample(noise, sigmas, callback)

    def sample(self, noise, sigmas, callback=None):
        self.conds = {k: [dict(c) for c in v] for k, v in self.original_conds.items()}
        self.model_options = copy.deepcopy(self.model_patcher.model_options)
        patcher_extension.merge_nested_dicts(self.model_options["transformer_options"].setdefault("wrappers", {}),
                                             self.model_patcher.wrappers, copy_dict1=False)
        executor = patcher_extension.WrapperExecutor.new_class_executor(
            self.outer_sample, self,
            patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.OUTER_SAMPLE, self.model_options,
                                               is_model_options=True))
        return executor.execute(noise, sigmas, callback)


def normal_sigmas(model_sampling, steps: int) -> torch.Tensor:
    ts = torch.linspace(999, 0, steps)
    sig = torch.stack([model_sampling.sigmas[int(t)] for t in ts])
    return torch.cat([sig, sig.new_zeros(1)])


def simple_sigmas(model_sampling, steps: int) -> torch.Tensor:
    """ComfyUI's ``simple`` scheduler: evenly spaced over the model's sigma table, then 0."""
    sigs = model_sampling.sigmas
    ss = len(sigs) / steps
    return torch.cat([torch.stack([sigs[-(1 + int(i * ss))] for i in range(steps)]), sigs.new_zeros(1)])
