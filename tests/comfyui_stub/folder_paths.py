"""``folder_paths``: where ComfyUI keeps models (the tests point it at a temporary folder)."""

models_dir = "models"
