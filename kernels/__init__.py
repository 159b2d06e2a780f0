"""batchinfer's kernels, installed as `batchinfer.kernels` (see pyproject.toml)."""
if __name__ == "kernels":
    # Found as a top-level `kernels` because a checkout's root is on sys.path (python run
    # from it). That name belongs to the Hugging Face kernels package, which transformers
    # imports when it is installed: load that one, from the rest of sys.path, in our place.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns this module
    _spec.loader.exec_module(_module)
