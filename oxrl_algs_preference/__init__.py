"""oxrl-algs-preference: DPO, IPO, ORPO, KTO, SimPO, RM, OnlineDPO, SPIN for oxRL, one module and one entry point each."""
