"""The layer both front ends share: ``port`` (the ``ClientPort`` interface through which the
service reaches its client, implemented by the native and the ACP front ends) and
``rounds`` (multi-round operate)."""
