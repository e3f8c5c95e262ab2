import os
import sys

# Triton kernels run on CPU through the interpreter in the test suite (set before triton loads).
if not os.environ.get("CUDA_VISIBLE_DEVICES_FOR_TESTS"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
