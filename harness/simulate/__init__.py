"""The schedule simulator: a discrete-event model of the PP schedules and CP prefix-K/V communication
(``pipeline``, ``cp``), its paper-scale Claim-1 panels (``claim1``) and its check against measured records
(``validate``)."""
