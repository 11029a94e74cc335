"""Claim 2: the closed GRPO loop (``loop``, ``run``, its task ``task``, warm start ``warmstart``), its spec
(``spec``), traces and their replay (``trace``, ``precision``), analysis (``analysis``), files (``io``) and
its ranks (``ranks``: what they share; ``launch``: starting them)."""
