"""One entry point per dataset. Each registers an import path, so discovery never imports
`datasets` or math-verify (they load when a run reads the dataset).

The MATH module is `hendrycks_math.py`, not `math.py`: a module named like a standard-library
one shadows it whenever this directory is the working directory.
"""

from oxrl_core import hookimpl


@hookimpl
def register_datasets(register):
    register("gsm8k", "oxrl_datasets.gsm8k:GSM8K")
    register("math", "oxrl_datasets.hendrycks_math:HendrycksMath")
    register("openr1_math", "oxrl_datasets.openr1_math:OpenR1Math")
    register("ultrafeedback_binarized", "oxrl_datasets.ultrafeedback:UltraFeedbackBinarized")
    register("hh_rlhf", "oxrl_datasets.hh_rlhf:HHRLHF")
    register("alpaca", "oxrl_datasets.alpaca:Alpaca")
    register("hf", "oxrl_datasets.mapped:MappedDataset")
