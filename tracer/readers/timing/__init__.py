"""Where a step's time went.

A trajectory's wall time split into generate, tool, reward, other and gap, its slow span and the
step's stragglers (:mod:`.breakdown`), the export's ``steps`` table (:mod:`.steps_table`) and the
report's time panel (:mod:`.report`). Computed from the spans' start and end times only.
"""
