"""Bad input ends a script with one line that names the problem and the fix, never a traceback."""
import sys


class UserError(Exception):
    """Bad input from the user (a config, data, a checkpoint, an argument)."""


class PeerLost(UserError):
    """Not bad input: another rank of the run is gone (killed, its node lost, hung), so this one
    cannot go on. One line all the same (stepgpt/runtime.py names the rank), not a collective's
    traceback; a restart continues the run."""


def run_cli(main):
    """main(argv) for a script: a UserError ends it with one line on stderr and exit status 2."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        # one write, newline included: the ranks of a job share stderr, and print's two writes (the
        # text, then the newline) of two ranks can interleave into one line
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        sys.exit(2)
