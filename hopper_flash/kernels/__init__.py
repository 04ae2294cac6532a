"""Device code: the Gluon forward kernel and the pieces it is composed from.

Nothing here imports torch; host-side planning lives in ``hopper_flash.plan``.
"""
