"""The what-if planner: step time, MFU and memory of layouts no run measured, from the runs that were.

``calibration`` (what the measured runs say: compute rates, link fits, memory residuals) ->
``layouts`` (the candidate layouts, checked by the trainer's own rules in ``agent.contract.layout``) ->
``links`` (bus bandwidth per group size) -> ``predict`` (a calibration and a layout to a prediction,
and the uncalibrated textbook model) -> ``whatif`` (what ``meshscope plan`` and the What-if page show)
-> ``cli`` (``meshscope plan``). The pipeline schedule replay and the memory model it uses are the
pages' own (``dashboard.pipeline_sim``, ``dashboard.memory_model``).
"""
