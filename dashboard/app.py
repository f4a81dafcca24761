"""meshscope dashboard entry file: ``meshscope dashboard --store DIR`` runs
``streamlit run dashboard/app.py -- --store DIR [--store DIR2 ...] [--prometheus URL]`` (several stores,
e.g. one per node of a multi-node job, read as one).

Pages live in ``dashboard/app_pages/`` (not ``pages/``, which would trigger Streamlit's legacy
auto-discovery); logic lives in plain modules under ``dashboard/``.
"""

import sys

import streamlit as st

from meshscope.dashboard import ui

st.set_page_config(page_title="meshscope", layout="wide")
ui.init(sys.argv[1:])
RUNS = st.Page("app_pages/runs.py", title="Runs", url_path="runs")
PAGES = [
    # Streamlit serves its default page at "/" only, so a default Runs page would make "/runs" a "Page not
    # found": the default is a hidden page that sends "/" to "/runs", and every page has its own path.
    st.Page(lambda: st.switch_page(RUNS), title="meshscope", url_path="home", default=True, visibility="hidden"),
    RUNS,
    st.Page("app_pages/overview.py", title="Overview", url_path="overview"),
    st.Page("app_pages/pipeline.py", title="Pipeline", url_path="pipeline"),
    st.Page("app_pages/communication.py", title="Communication", url_path="communication"),
    st.Page("app_pages/memory.py", title="Memory", url_path="memory"),
    st.Page("app_pages/scaling.py", title="Scaling", url_path="scaling"),
    st.Page("app_pages/compare.py", title="Compare", url_path="compare"),
    st.Page("app_pages/whatif.py", title="What-if", url_path="whatif"),
    st.Page("app_pages/gpu.py", title="GPU", url_path="gpu"),
    st.Page("app_pages/live.py", title="Live", url_path="live"),
]
page = st.navigation(PAGES)
ui.sidebar()
page.run()
