"""Memory: where bytes live and how they move between the device and host memory.

Owns every CUDA stream, event and copy worker (``transport``), the memories (device slots, pinned and
packed host copies, the machine's shared copy, the disk tier) and the model of a layer's bytes they are sized from.
Knows nothing of layers' order or hooks, and of full fine-tuning only where its state lives (``TrainingLayout``).

Modules
    - ``transport.py``: every copy in every direction (weights in, gradients home, activations out and back,
      optimizer state in and out, disk reads) behind one vocabulary (submit, acquire, mark, land); the one owner of the
      copy streams, events and the worker threads; its CPU backend poisons a destination and lands the bytes
      late, so a missing wait in any direction fails a CPU test.
    - ``copier.py``: the weight slot rule on top of the transport (a slot is written only after its readers).
    - ``device_pool.py``: the fixed device slots that streamed layers occupy.
    - ``host_store.py``: the packed host copies of streamed layers, pinned within the budget (or in the disk tier).
    - ``disk_tier.py``: the third memory: spilled layers in an unnamed file on a local disk, read into a ring of
      pinned staging buffers before their copy to the device; the directory checked before anything is written.
    - ``disk_io.py``: how the disk tier reads (DeepSpeed's async I/O where it builds, else direct-I/O ``preadv``
      from threads) and writes back (full fine-tuning's state).
    - ``mapped_safetensors.py``: a checkpoint's tensors as views of a private mapping of its file (a load that copies
      nothing into process memory; safetensors' own CPU reads already are such views: see ``file_backed.py``).
    - ``file_backed.py``: how many bytes of the layers' weights are views of their checkpoint files and how many are
      copies (casts) in process memory, for the start-up line.
    - ``pinned.py``: page-locked host memory of exact size.
    - ``peers.py``: one shared host copy per machine for the processes that hold the same layers.
    - ``shm_space.py``: room in ``/dev/shm`` for that shared copy, checked before anything is written.
    - ``fetch_share.py``: those processes each copy a share of every streamed layer and gather the rest from the
      others (NVLink), so the host sends each layer once per machine.
    - ``layout.py``: the one model of a layer's bytes (params, casts, slot, copy and landing sizes) and of the
      training state's (``TrainingLayout``); byte units.
    - ``precision.py``: dtype names, which frozen params ``cast_target`` casts, fp8 scaling, autocast's dtypes.
    - ``monitor.py``: VRAM and RAM readings, and warnings before the host runs short.

May import: nothing else of DGLS but the root modules.
"""
