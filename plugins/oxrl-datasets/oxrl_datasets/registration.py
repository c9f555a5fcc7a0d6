"""One entry point per dataset. Each registers an import path, so discovery never imports
`datasets` or math-verify (they load when a run reads the dataset).

The MATH module is `hendrycks_math.py`, not `math.py`: a module named like a standard-library
one shadows it whenever this directory is the working directory.
"""

from oxrl_core.hookspecs import Registers

gsm8k = Registers("dataset", "gsm8k", "oxrl_datasets.gsm8k:GSM8K")
math = Registers("dataset", "math", "oxrl_datasets.hendrycks_math:HendrycksMath")
openr1_math = Registers("dataset", "openr1_math", "oxrl_datasets.openr1_math:OpenR1Math")
ultrafeedback_binarized = Registers(
    "dataset", "ultrafeedback_binarized", "oxrl_datasets.ultrafeedback:UltraFeedbackBinarized"
)
hh_rlhf = Registers("dataset", "hh_rlhf", "oxrl_datasets.hh_rlhf:HHRLHF")
alpaca = Registers("dataset", "alpaca", "oxrl_datasets.alpaca:Alpaca")
hf = Registers("dataset", "hf", "oxrl_datasets.mapped:MappedDataset")
