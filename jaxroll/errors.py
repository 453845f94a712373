"""The one base class of the errors a user can fix.

Every error whose message names a problem in the user's input (a config
key, a file, a run folder) derives from `JaxrollError`; the `jaxroll`
command prints such an error as one line and exits with code 2
(`--debug` or JAXROLL_DEBUG=1 shows the traceback). Anything else is a
bug in jaxroll and keeps its traceback. This module imports nothing, so
that config and run-folder checks can raise these before JAX is loaded.
"""


class JaxrollError(Exception):
  """A problem with the user's input; the message names it and the fix."""
