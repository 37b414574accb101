"""``modules/options.py`` (A1111 1.6+): ``OptionInfo`` and ``Options``."""

from __future__ import annotations

import json


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None, section=None,
                 refresh=None, comment_before="", comment_after="", infotext=None, restrict_api=False,
                 category_id=None):
        self.default = default
        self.label = label
        self.component = component
        self.component_args = component_args
        self.onchange = onchange
        self.section = section
        self.category_id = category_id
        self.refresh = refresh
        self.do_not_save = False
        self.comment_before = comment_before
        self.comment_after = comment_after
        self.infotext = infotext
        self.restrict_api = restrict_api

    def info(self, info):
        self.comment_after += f"<span class='info'>({info})</span>"
        return self

    def needs_restart(self):
        self.comment_after += " <span class='info'>(requires restart)</span>"
        return self


class Options:
    typemap = {int: float}

    def __init__(self, data_labels: dict, restricted_opts=()):
        self.data_labels = data_labels
        self.data = {k: v.default for k, v in self.data_labels.items() if not v.do_not_save}
        self.restricted_opts = restricted_opts

    def __setattr__(self, key, value):
        if key in ("data_labels", "data", "restricted_opts"):
            return super().__setattr__(key, value)
        if self.data is not None and (key in self.data or key in self.data_labels):
            self.data[key] = value
            return None
        return super().__setattr__(key, value)

    def __getattr__(self, item):
        if item in ("data", "data_labels", "restricted_opts"):
            raise AttributeError(item)
        if self.data is not None and item in self.data:
            return self.data[item]
        if item in self.data_labels:
            return self.data_labels[item].default
        return super().__getattribute__(item)

    def set(self, key, value, is_api=False, run_callbacks=True):
        oldval = self.data.get(key, None)
        if oldval == value:
            return False
        self.data[key] = value
        info = self.data_labels.get(key)
        if run_callbacks and info is not None and info.onchange is not None:
            info.onchange()
        return True

    def save(self, filename):
        with open(filename, "w", encoding="utf8") as file:
            json.dump(self.data, file, indent=4, ensure_ascii=False)

    def add_option(self, key, info):
        self.data_labels[key] = info
        if key not in self.data and not info.do_not_save:
            self.data[key] = info.default
