"""What the policy does, and whether its reward was earned.

Behaviour groups (tools called, finish reason, answer form; :mod:`.behaviour`, :mod:`.signature`,
:mod:`.near_dup`), earned reward (:mod:`.earned`: correctness against what a step pays), the
independent evidence used when no correctness signal exists (:mod:`.independent`), and the
patterns tables, flags and report sections built from them (:mod:`.patterns` and its SQL and
Python halves, :mod:`.patterns_report`, :mod:`.evidence`). Read from the export's tables only.
"""
