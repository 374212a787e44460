"""Speculative decoding: proposers guess a request's next tokens cheaply, and one forward of the
target model (``ForwardMode.TARGET_VERIFY``) scores every guess; the standard rejection-sampling
rule (Leviathan et al. 2023, Chen et al. 2023) keeps the output distribution the target's.

- ``spec_args.py``: the ``SpeculativeArgs`` section, its flags (SGLang's names) and the rules
  that refuse what does not compose.
- ``proposer.py``: the ``Proposer`` interface and the registry of algorithms.
- ``ngram.py``: ``NgramProposer`` (prompt lookup; no extra model).
- ``acceptance.py``: the acceptance rule (greedy and rejection sampling), on tensors.
"""
