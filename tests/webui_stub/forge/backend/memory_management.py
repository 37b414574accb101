"""``backend/memory_management.py``: free memory decides how many cond/uncond rows Forge batches."""

FREE_MEMORY = 1 << 40  # bytes; tests lower it to make Forge split its batches


def get_free_memory(dev=None, torch_free_too=False):
    return FREE_MEMORY
