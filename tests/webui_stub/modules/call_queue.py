"""``modules/call_queue.py``: the lock every generation holds."""

import threading

queue_lock = threading.Lock()
