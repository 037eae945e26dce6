"""Layer 4, the RL and preference metrics: GRPO and its variants, PPO, DPO, completion rewards, the rollout
mismatch.
"""
