"""peagle_ext beside other projects' trainers: `speculators` (vllm-project/speculators)."""
