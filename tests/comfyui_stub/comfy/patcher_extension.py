"""``comfy.patcher_extension``: wrapper types and the executor that chains them."""

from __future__ import annotations


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    PREPARE_SAMPLING = "prepare_sampling"
    SAMPLER_SAMPLE = "sampler_sample"
    PREDICT_NOISE = "predict_noise"
    CALC_COND_BATCH = "calc_cond_batch"
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"

    @classmethod
    def init_wrappers(cls):
        return {}


def get_all_wrappers(wrapper_type, transformer_options, is_model_options=False):
    if is_model_options:
        transformer_options = transformer_options.get("transformer_options", {})
    out = []
    for fns in transformer_options.get("wrappers", {}).get(wrapper_type, {}).values():
        out.extend(fns)
    return out


def merge_nested_dicts(dict1: dict, dict2: dict, copy_dict1=True):
    merged = dict(dict1) if copy_dict1 else dict1
    for key, value in dict2.items():
        if isinstance(value, dict):
            merged[key] = merge_nested_dicts(merged.get(key, {}), value, copy_dict1)
        elif isinstance(value, list):
            merged[key] = merged.get(key, []) + value
        else:
            merged[key] = value
    return merged


class WrapperExecutor:
    """Calls the wrappers in order, each given the executor for the rest, then ``original``."""

    def __init__(self, original, class_obj, wrappers, idx):
        self.original = original
        self.class_obj = class_obj
        self.wrappers = list(wrappers)
        self.idx = idx
        self.is_last = idx == len(self.wrappers)

    def __call__(self, *args, **kwargs):
        return WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(*args, **kwargs)

    def execute(self, *args, **kwargs):
        if self.is_last:
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)

    @classmethod
    def new_executor(cls, original, wrappers, idx=0):
        return cls(original, None, wrappers, idx)

    @classmethod
    def new_class_executor(cls, original, class_obj, wrappers, idx=0):
        return cls(original, class_obj, wrappers, idx)
