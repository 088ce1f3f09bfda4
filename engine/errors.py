"""The one exception type that means "the user asked for something we cannot do"."""


class UserError(Exception):
    """A bad flag, file or setup. run.py prints its message as one line and exits 2.

    The message names the bad input and says what to do; no traceback is shown.
    """

    exit_code = 2
