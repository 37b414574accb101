"""TensorRT without a GPU: the names the backend uses (``api_names``), the real binding modules'
name lists (``names/``, made by ``scripts/trt_names.py``) and a stand-in ``tensorrt`` (``dryrun``)."""
