"""``modules/extra_networks.py``: ``<name:args>`` prompt tags -> ``ExtraNetworkParams``."""

from __future__ import annotations

import re

re_extra_net = re.compile(r"<(\w+):([^>]+)>")


class ExtraNetworkParams:
    def __init__(self, items=None):
        self.items = items or []
        self.positional = []
        self.named = {}
        for item in self.items:
            parts = item.split("=", 2) if isinstance(item, str) else [item]
            if len(parts) == 2:
                self.named[parts[0]] = parts[1]
            else:
                self.positional.append(item)


def parse_prompt(prompt):
    res = {}

    def found(m):
        res.setdefault(m.group(1), []).append(ExtraNetworkParams(items=m.group(2).split(":")))
        return ""

    prompt = re.sub(re_extra_net, found, prompt)
    return prompt, res


def parse_prompts(prompts):
    res, extra_data = [], None
    for prompt in prompts:
        updated_prompt, parsed_extra_networks = parse_prompt(prompt)
        if extra_data is None:
            extra_data = parsed_extra_networks
        res.append(updated_prompt)
    return res, extra_data
