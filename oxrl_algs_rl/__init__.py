"""oxrl-algs-rl: SGRPO, CISPO, PPO, RLHF, RLAIF for oxRL, one module and one entry point each."""
