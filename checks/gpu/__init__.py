"""The correctness checks ``scripts/gpu_check.sh`` runs on a machine with one GPU, torch and Triton: ``mxfp4``
(part 6: the MXFP4 experts at Kimi K2/K3 shapes, their kernel, the slot-fill race) and ``k3`` (part 7: one Kimi K3
MoE layer with SiTU). Their CPU twins, under Triton's interpreter, are in ``tests/support/``."""
