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


class ExtraNetwork:
    def __init__(self, name):
        self.name = name

    def activate(self, p, params_list):
        raise NotImplementedError

    def deactivate(self, p):
        raise NotImplementedError


extra_network_registry = {}


def register_extra_network(extra_network):
    extra_network_registry[extra_network.name] = extra_network


def activate(p, extra_network_data):
    """Each registered network with the job's tags of its kind, the others with none (so a job
    without a tag switches their effect off); unknown kinds are skipped, as A1111 does."""
    activated = []
    for name, params_list in (extra_network_data or {}).items():
        extra_network = extra_network_registry.get(name)
        if extra_network is None:
            continue
        extra_network.activate(p, params_list)
        activated.append(extra_network)
    for extra_network in extra_network_registry.values():
        if extra_network not in activated:
            extra_network.activate(p, [])


def deactivate(p, extra_network_data):
    for extra_network in extra_network_registry.values():
        extra_network.deactivate(p)
