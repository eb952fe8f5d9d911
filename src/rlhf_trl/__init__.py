"""rlhf_trl: three-stage RLHF (SFT -> reward model -> PPO) as a thin layer over Hugging Face TRL.

Stages are importable modules with a ``main(argv)`` entry point: `rlhf_trl.sft`, `rlhf_trl.rm`, `rlhf_trl.ppo`;
`rlhf_trl.data` is the one data formatter they share; `rlhf_trl.demo` runs all three on a generated task.
"""

__version__ = "0.1.0"
