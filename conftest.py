"""Collection for the whole repository (the tests' fixtures are in tests/conftest.py).

pytest collects the doctests of every module under its testpaths (pyproject.toml:
``--doctest-modules``); these cannot be imported outside their host, so they are left out.
"""

collect_ignore = [
    # Imports the WebUI's own ``modules`` package at the top: it only imports inside AUTOMATIC1111
    # (tests/test_webui_extension.py runs it against tests/webui_stub).
    "sd_accel/webui/a1111.py",
    # A stand-in WebUI tree (``modules``, ``ldm``, ``backend``, launch.py) that the extension tests put
    # on sys.path themselves; importing it for doctests would shadow those packages for every test.
    "tests/webui_stub",
    # The same for the stand-in ComfyUI (``comfy``, ``folder_paths``): tests/test_comfyui_pack.py loads it.
    "tests/comfyui_stub",
]
