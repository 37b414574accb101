"""sd-accel's ComfyUI node pack: link or copy this folder into ComfyUI's ``custom_nodes/``
(``custom_nodes/sd-accel``) and install the sd-accel package into ComfyUI's Python
(``pip install -e /path/to/sd-accel``; it leaves ComfyUI's pinned packages as they are).

Thin on purpose: the nodes live in ``sd_accel.comfyui.nodes``. When the package cannot be
imported, the pack still loads, with one node that says why (instead of an import error that
hides the pack).
"""

import logging

try:
    from sd_accel.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, setup

    setup()
except Exception as exc:  # noqa: BLE001  (any failure: say it in a node, never hide the pack)
    WHY = (f"sd-accel is not usable in this ComfyUI's Python: {type(exc).__name__}: {exc}. Install it there: "
           "<ComfyUI's python> -m pip install -e /path/to/sd-accel, then restart ComfyUI.")
    logging.getLogger("sd_accel").error("%s", WHY)

    class SdAccelUnavailable:
        """Shown instead of the pack's nodes when sd-accel cannot be imported."""

        DESCRIPTION = WHY
        RETURN_TYPES = ("STRING",)
        FUNCTION = "why"
        CATEGORY = "sd-accel"
        OUTPUT_NODE = True

        @classmethod
        def INPUT_TYPES(cls):  # noqa: N802
            return {"required": {}}

        def why(self):
            raise RuntimeError(WHY)

    NODE_CLASS_MAPPINGS = {"SdAccelUnavailable": SdAccelUnavailable}
    NODE_DISPLAY_NAME_MAPPINGS = {"SdAccelUnavailable": "sd-accel (not installed)"}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
