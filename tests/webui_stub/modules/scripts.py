"""``modules/scripts.py``: ``Script``, ``AlwaysVisible``, loading and running scripts.

``load_scripts`` loads every ``scripts/*.py`` of the given extension folders with the extension
folder on ``sys.path`` during the load, and registers each ``Script`` subclass found in the
module's namespace (``register_scripts_from_module``), as the WebUI does.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from collections import namedtuple

from modules import script_loading

AlwaysVisible = object()


class Script:
    name = None
    section = None
    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    group = None
    infotext_fields = None
    paste_field_names = None
    sorting_priority = 0  # Forge

    def title(self):
        raise NotImplementedError()

    def ui(self, is_img2img):
        pass

    def show(self, is_img2img):
        return True

    def run(self, p, *args):
        pass

    def setup(self, p, *args):
        pass

    def before_process(self, p, *args):
        pass

    def process(self, p, *args):
        pass

    def before_process_batch(self, p, *args, **kwargs):
        pass

    def after_extra_networks_activate(self, p, *args, **kwargs):
        pass

    def process_batch(self, p, *args, **kwargs):
        pass

    def process_before_every_sampling(self, p, *args, **kwargs):  # Forge
        pass

    def postprocess_batch(self, p, *args, **kwargs):
        pass

    def before_hr(self, p, *args):
        pass

    def postprocess(self, p, processed, *args):
        pass


ScriptClassData = namedtuple("ScriptClassData", ["script_class", "path", "basedir", "module"])
scripts_data: list[ScriptClassData] = []


def load_scripts(extension_dirs):
    scripts_data.clear()
    syspath = sys.path

    def register_scripts_from_module(module, path, basedir):
        for script_class in module.__dict__.values():
            if not inspect.isclass(script_class):
                continue
            if issubclass(script_class, Script) and script_class is not Script:
                scripts_data.append(ScriptClassData(script_class, path, basedir, module))

    for basedir in extension_dirs:
        folder = os.path.join(basedir, "scripts")
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if not name.endswith(".py"):
                continue
            try:
                sys.path = [basedir] + sys.path
                module = script_loading.load_module(path)
                register_scripts_from_module(module, path, basedir)
            except Exception:
                print(f"Error loading script: {name}\n{traceback.format_exc()}")
            finally:
                sys.path = syspath


class ScriptRunner:
    def __init__(self):
        self.scripts = []
        self.alwayson_scripts = []
        self.selectable_scripts = []

    def initialize_scripts(self, is_img2img):
        self.scripts.clear()
        self.alwayson_scripts.clear()
        for script_data in scripts_data:
            script = script_data.script_class()
            script.filename = script_data.path
            script.is_txt2img = not is_img2img
            script.is_img2img = is_img2img
            visibility = script.show(script.is_img2img)
            if visibility == AlwaysVisible:
                self.scripts.append(script)
                self.alwayson_scripts.append(script)
                script.alwayson = True
                script.args_from = script.args_to = 0
        self.alwayson_scripts.sort(key=lambda x: x.sorting_priority)

    def _run(self, hook, p, *args, **kwargs):
        for script in self.alwayson_scripts:
            try:
                script_args = p.script_args[script.args_from:script.args_to]
                getattr(script, hook)(p, *args, *script_args, **kwargs)
            except Exception:
                print(f"Error running {hook}: {script.filename}\n{traceback.format_exc()}")

    def process(self, p):
        self._run("process", p)

    def process_batch(self, p, **kwargs):
        self._run("process_batch", p, **kwargs)

    def process_before_every_sampling(self, p, **kwargs):
        self._run("process_before_every_sampling", p, **kwargs)

    def before_hr(self, p):
        self._run("before_hr", p)

    def postprocess(self, p, processed):
        self._run("postprocess", p, processed)


scripts_txt2img = ScriptRunner()
