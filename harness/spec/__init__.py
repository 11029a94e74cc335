"""Specs: YAML (read safely, ``safe_yaml``) -> :class:`~harness.spec.schema.Spec` -> cells
(:mod:`harness.spec.load`), with the checks beyond the schema (:mod:`harness.spec.checks`) and the cell
model every stage after this one reads (:mod:`harness.spec.cell`)."""
