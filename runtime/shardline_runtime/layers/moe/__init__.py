"""Mixture-of-experts layers: the router (``router.py``), ``FusedMoE`` with its expert
placement (``fused_moe.py``, ``expert_location.py``), expert computation (``moe_compute.py``,
``triton_fused_moe.py``), the expert-distribution recorder (``recorder.py``) and EPLB
(``eplb_algorithm.py`` computes a placement, ``expert_rebalance.py`` applies it in place)."""
