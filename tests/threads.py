"""Python threads for the tests that call ktfp8 from several at once."""
import threading


def run_in_threads(target, args_of_each):
    """target(*args) on one thread per entry of args_of_each, all started, then all joined."""
    threads = [threading.Thread(target=target, args=args) for args in args_of_each]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
