"""`ArrayApiBackend`: the `AutodiffBackend` of any array-API library, built on array-api-compat.

An adapter for a library that follows the Python array API standard (numpy, array-api-strict,
CuPy, torch and JAX through array-api-compat, ...) takes its backend from here and writes only
its module, optimizer and scheduler bindings (spec/ADAPTERS.md, "Writing an adapter for an
array-API library"). The numpy reference adapter's `NumpyBackend` is this class bound to numpy.

What the standard gives, this module uses, and nothing else:

- dispatch: `array_api_compat.array_namespace(x)` names an array's library; a backend handles
  the arrays of its own namespace and refuses every other one with a `TypeError`;
- devices: `__array_namespace_info__().devices()`, `array_api_compat.device(x)` and
  `to_device`; strings name a device by its own `str()` or by its DLPack kind and index
  (`"cpu"`, `"cpu:0"`, `"cuda:1"`, `"gpu:1"`, `"rocm:0"`, ...);
- dtypes: the standard's names (`float32`, `int64`, `bool`, ...) with
  `__array_namespace_info__().dtypes(device=...)` deciding which a device has, plus
  `float16` / `bfloat16` where the namespace names them (or the adapter passes them);
- host transfer: `numpy.from_dlpack` (or `numpy.asarray`) to read back, the namespace's
  `asarray(..., device=, copy=True)` (or `from_dlpack`) to upload. f16/bf16 that a library
  cannot exchange with numpy travel as their i16 bits where its arrays have `view(dtype)`
  (torch), else through f32, which holds every such value exactly (a NaN's sign and
  payload are then the library's choice).

Importing this module imports no framework: a namespace is only ever one the caller passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np

from ..items.dtypes import DType
from ..items.tensor import TensorData

__all__ = ["ArrayApiBackend", "ArrayApiAdapter"]

Tensor = Any
"""An array of the backend's library."""
Device = Any
"""A device object of the backend's library (numpy's is the string "cpu")."""
HostArray = np.ndarray[Any, Any]

# the standard's dtype names; f16 and bf16 are not in the standard but libraries use these names
_NAMES: dict[DType, str] = {
    DType.F64: "float64", DType.F32: "float32", DType.F16: "float16", DType.BF16: "bfloat16",
    DType.I64: "int64", DType.I32: "int32", DType.I16: "int16", DType.I8: "int8",
    DType.U8: "uint8", DType.U16: "uint16", DType.U32: "uint32", DType.U64: "uint64",
    DType.BOOL: "bool",
}
_OUTSIDE_STANDARD = frozenset({DType.F16, DType.BF16})

# DLPack device types (dlpack.h `DLDeviceType`) and the names trainrec accepts for them
_DLPACK_KINDS: dict[int, tuple[str, ...]] = {
    1: ("cpu",), 2: ("cuda", "gpu"), 4: ("opencl",), 7: ("vulkan",), 8: ("metal", "mps"),
    10: ("rocm", "gpu"), 14: ("oneapi", "xpu"),
}
_CPU = 1

# what a library raises when it cannot make or read an array one way (then the next is tried)
_CANNOT = (TypeError, ValueError, RuntimeError, BufferError, NotImplementedError, AttributeError)


class ArrayApiBackend:
    """The `AutodiffBackend` of one array-API library.

    `ArrayApiBackend(xp)` takes the library's namespace (a module such as `numpy` or
    `array_api_strict`) or any array of the library; the namespace used is
    `array_api_compat.array_namespace` of such an array, so numpy, torch and JAX get
    array-api-compat's standard-conforming wrappers. `name` defaults to the library's
    package name. `dtypes` gives native dtypes for the `DType`s the namespace does not
    name (numpy: `{DType.BF16: ml_dtypes.bfloat16}`); its keys are read at once, each value
    only when that dtype is first needed, so that a mapping may import a slow module there
    (numpy's `NumpyBackend` imports ml_dtypes, about a second of CPU, at its first bf16).

    Every method refuses an array of another library (`TypeError`). A dtype the library
    or the device lacks is a `TypeError` naming it; a device it does not have a
    `ValueError` listing those it has.

    Example:
        >>> import array_api_strict as xp
        >>> backend = ArrayApiBackend(xp)
        >>> t = backend.from_host(np.arange(3, dtype=np.float32), "cpu")
        >>> backend.to_host(backend.add(t, t))
        array([0., 2., 4.], dtype=float32)
    """

    def __init__(self, xp: Any, *, name: str | None = None,
                 dtypes: Mapping[DType, Any] | None = None) -> None:
        self.xp: ModuleType = _namespace(xp)
        self.name: str = name or _library_name(self.xp)
        standard = {d: getattr(self.xp, n) for d, n in _NAMES.items() if hasattr(self.xp, n)}
        # a plain dict is copied (a caller's later change does not reach us); another
        # Mapping is kept, so that its values are read only when first needed
        given: Mapping[DType, Any] = dict(dtypes) if type(dtypes) is dict else (dtypes or {})
        self._kinds: tuple[DType, ...] = tuple(dict.fromkeys([*standard, *given]))
        self._native: dict[DType, Any] = {d: v for d, v in standard.items() if d not in given}
        self._given = given  # each value read by `_native_of` when its dtype is first needed
        self._array_type: type = type(self.xp.asarray(0))
        self._tensor_types: dict[type, bool] = {}
        self._devices: list[tuple[Device, tuple[str, ...]]] | None = None
        self._on_device: dict[Any, tuple[DType, ...]] = {}

    # -- tensors ---------------------------------------------------------------------------

    def is_tensor(self, obj: Any) -> bool:
        """Whether `obj` is an array of this library (its `array_namespace` is ours)."""
        tp = type(obj)
        known = self._tensor_types.get(tp)
        if known is None:
            try:
                known = array_api_compat.array_namespace(obj) is self.xp
            except TypeError:
                known = False
            self._tensor_types[tp] = known
        return known

    def is_tensor_type(self, tp: type) -> bool:
        """Whether `tp` is the library's array type (or a subclass)."""
        return isinstance(tp, type) and issubclass(tp, self._array_type)

    def dtype_of(self, tensor: Tensor) -> DType:
        return self._dtype(self._own(tensor, "dtype_of"))

    def _dtype(self, tensor: Tensor) -> DType:
        native = tensor.dtype
        for dtype, candidate in list(self._native.items()):  # `_native_of` may add to it
            if native == candidate:
                return dtype
        for dtype in self._kinds:  # the adapter's dtypes not read yet
            if dtype not in self._native and native == self._native_of(dtype):
                return dtype
        if isinstance(native, np.dtype):  # e.g. a big-endian numpy array
            return DType.from_numpy(native)
        raise TypeError(f"{self.name} dtype {native} cannot be recorded; trainrec records "
                        + ", ".join(d.value for d in DType))

    def shape_of(self, tensor: Tensor) -> tuple[int, ...]:
        return tuple(int(n) for n in self._own(tensor, "shape_of").shape)

    def dtypes(self, device: Any = None) -> tuple[DType, ...]:
        """The `DType`s this library has on `device` (default: its default device)."""
        return tuple(self._dtypes_on(self.device(device)))

    # -- devices ---------------------------------------------------------------------------

    def device(self, spec: Any) -> Device:
        """The library's device for `spec`: None (the default device), one of its device
        objects, or a string naming one (see the module docstring). `ValueError` for any
        other."""
        devices = self._device_table()
        if spec is None:
            return self._default_device()
        for dev, _ in devices:
            if _same(dev, spec):
                return dev
        if isinstance(spec, str):
            for dev, names in devices:
                if spec in names:
                    return dev
        have = "; ".join(" or ".join(repr(n) for n in names) for _, names in devices)
        raise ValueError(f"{spec!r} is not a device of {self.name}; it has {have}")

    def device_of(self, tensor: Tensor) -> Device:
        return array_api_compat.device(self._own(tensor, "device_of"))

    def is_device(self, obj: Any) -> bool:
        """Whether `obj` is one of the library's device objects."""
        return not isinstance(obj, str) and any(_same(d, obj) for d, _ in self._device_table())

    # -- host transfer ---------------------------------------------------------------------

    def to_host(self, tensor: Tensor) -> HostArray:
        """A new C-contiguous numpy array holding `tensor`'s values, in its dtype."""
        return np.array(self._read(self._own(tensor, "to_host")), order="C", copy=True)

    async def to_host_async(self, tensor: Tensor) -> HostArray:
        """`to_host` (the standard has no asynchronous readback; an adapter whose library
        has one overrides this)."""
        return self.to_host(tensor)

    def from_host(self, array: HostArray, device: Any) -> Tensor:
        """A new array of this library on `device`, equal to `array` in values and dtype,
        sharing no memory with it."""
        dev = self.device(device)
        dtype = DType.from_numpy(array.dtype)
        native = self._native_dtype(dtype, dev)
        host = np.asarray(array, order="C")  # a 0-d array stays 0-d (ascontiguousarray: 1-d)
        out = _first(
            lambda: self.xp.asarray(host, dtype=native, device=dev, copy=True),
            # from a copy of ours: whatever from_dlpack shares, no one else holds it
            lambda: array_api_compat.to_device(self.xp.from_dlpack(np.array(host, copy=True)), dev),
            lambda: self._half_upload(host, dtype, dev),
            what=f"cannot upload a numpy {dtype.value} array to {self.name} on {dev!r}")
        if self._dtype(out) is not dtype:
            raise TypeError(f"{self.name} stored a {dtype.value} array as {self._dtype(out).value}")
        return out

    def to_tensor_data(self, tensor: Tensor) -> TensorData:
        """`tensor` read back as a record's `TensorData` (a host copy, in its dtype)."""
        return TensorData.from_array(self.to_host(tensor), copy=False)

    def from_tensor_data(self, data: TensorData, device: Any, dtype: DType | None = None) -> Tensor:
        """A new array on `device` holding `data`, converted to `dtype` first when given
        (a live tensor's dtype, as a restore needs)."""
        array = data.array if dtype is None else data.array.astype(dtype.numpy)
        return self.from_host(array, device)

    # -- arithmetic the accumulator needs --------------------------------------------------

    def cast(self, tensor: Tensor, dtype: DType) -> Tensor:
        """`tensor` in `dtype` (itself when it has it already)."""
        if self._dtype(self._own(tensor, "cast")) is dtype:
            return tensor
        return self.xp.astype(tensor, self._native_dtype(dtype, array_api_compat.device(tensor)))

    def clone(self, tensor: Tensor) -> Tensor:
        return self.xp.asarray(self._own(tensor, "clone"), copy=True)

    def add(self, pending: Tensor, grad: Tensor) -> Tensor:
        """`pending + grad` in `pending`'s dtype: in place where the library's arrays are
        writeable (the accumulator owns `pending`), a new array where they are not (JAX);
        `grad` is never written. Shapes must be equal (`ValueError`): nothing broadcasts."""
        self._own(pending, "add")
        self._own(grad, "add")
        if pending.shape != grad.shape:
            raise ValueError(f"cannot add a gradient of shape {tuple(grad.shape)} to one of "
                             f"shape {tuple(pending.shape)}")
        grad = self.cast(grad, self._dtype(pending))
        if array_api_compat.is_writeable_array(pending):
            pending += grad
            return pending
        return pending + grad

    # -- identity --------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ArrayApiBackend) and other.xp is self.xp
                and other.name == self.name)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    # -- internals -------------------------------------------------------------------------

    def _own(self, tensor: Any, method: str) -> Tensor:
        if not self.is_tensor(tensor):
            tp = type(tensor)
            raise TypeError(
                f"the {self.name} backend's {method} got a {tp.__module__}.{tp.__qualname__}, not an "
                f"array of {self.name}; give each framework's tensors to its own backend "
                "(trainrec.adapt(tensor) finds it)")
        return tensor

    def _device_table(self) -> list[tuple[Device, tuple[str, ...]]]:
        """Each device with the strings that name it, in the library's order."""
        if self._devices is None:
            info = getattr(self.xp, "__array_namespace_info__", None)
            listed = list(info().devices()) if info is not None else []
            devices = [d for d in listed if d is not None] or [self._default_device()]
            named = [(d, self._names(d)) for d in devices]
            # a name several devices share (array-api-strict's devices are all DLPack's
            # cpu:0) names the default device among them, else the first
            default = self._default_device()
            owner: dict[str, Device] = {}
            for d, names in sorted(named, key=lambda dn: not _same(dn[0], default)):
                for n in names:
                    owner.setdefault(n, d)
            self._devices = [(d, tuple(n for n in names if owner[n] is d)) for d, names in named]
        return self._devices

    def _names(self, dev: Device) -> tuple[str, ...]:
        names = [str(dev)]
        try:
            empty = self.xp.empty((0,), dtype=self.xp.bool, device=dev)
            kind, index = (int(v) for v in empty.__dlpack_device__())
        except (*_CANNOT, OverflowError):
            return tuple(names)
        for k in _DLPACK_KINDS.get(kind, ()):
            names += [f"{k}:{index}"] + ([k] if index == 0 else [])
        return tuple(dict.fromkeys(names))

    def _default_device(self) -> Device:
        info = getattr(self.xp, "__array_namespace_info__", None)
        default = info().default_device() if info is not None else None
        if default is None:  # JAX says None: "wherever arrays go by default"
            default = array_api_compat.device(self.xp.asarray(0))
        return default

    def _dtypes_on(self, dev: Device) -> tuple[DType, ...]:
        """The `DType`s `dev` has."""
        key = _key(dev)
        found = self._on_device.get(key)
        if found is None:
            info = getattr(self.xp, "__array_namespace_info__", None)
            listed: Any = None
            if info is not None:
                try:
                    listed = info().dtypes(device=dev)
                except TypeError:
                    listed = info().dtypes()
            found = tuple(d for d in self._kinds
                          if listed is None or d in _OUTSIDE_STANDARD or _NAMES[d] in listed)
            self._on_device[key] = found
        return found

    def _native_dtype(self, dtype: DType, dev: Device) -> Any:
        have = self._dtypes_on(dev)
        if dtype not in have:
            where = "" if dtype not in self._kinds else f" on device {dev!r}"
            raise TypeError(f"{self.name} has no {dtype.value} ({_NAMES[dtype]}){where}; it has "
                            + ", ".join(d.value for d in have))
        return self._native_of(dtype)

    def _native_of(self, dtype: DType) -> Any:
        """The native dtype of `dtype`, one of `_kinds`: the adapter's value read now if it
        has not been."""
        found = self._native.get(dtype)
        if found is None:
            found = self._native[dtype] = self._given[dtype]
        return found

    def _read(self, tensor: Tensor) -> HostArray:
        """A numpy array (perhaps a view) of `tensor`'s values, moved to the CPU first when
        it is on another kind of device."""
        if not _on_cpu(tensor):
            try:
                cpu = self.device("cpu")
            except ValueError:
                pass  # no device named cpu: the readers below may still manage
            else:
                tensor = array_api_compat.to_device(tensor, cpu)
        host: HostArray = _first(
            lambda: np.from_dlpack(tensor),
            lambda: np.asarray(tensor),
            lambda: self._half_read(tensor),
            what=f"cannot read a {self.name} array of dtype {tensor.dtype} back to numpy")
        return host

    def _half_read(self, tensor: Tensor) -> HostArray:
        """f16/bf16 numpy cannot take from the library: their bits as i16 where the array
        has `view(dtype)` (numpy, torch, CuPy), else through f32 (exact, except that a
        NaN's sign and payload are the library's choice)."""
        dtype = self._dtype(tensor)
        if dtype not in _OUTSIDE_STANDARD:
            raise TypeError(f"no numpy reader for {dtype.value}")
        if callable(getattr(tensor, "view", None)):
            try:
                bits = self._read(tensor.view(self._native_of(DType.I16)))
            except _CANNOT:
                pass
            else:
                return bits.view(dtype.numpy)
        return self._read(self.cast(tensor, DType.F32)).astype(dtype.numpy)

    def _half_upload(self, host: HostArray, dtype: DType, dev: Device) -> Tensor:
        """f16/bf16 the library cannot take from numpy, as `_half_read` reads them."""
        if dtype not in _OUTSIDE_STANDARD:
            raise TypeError(f"no numpy upload for {dtype.value}")
        native = self._native_dtype(dtype, dev)
        bits = self.xp.asarray(host.view(np.int16), device=dev, copy=True)
        if callable(getattr(bits, "view", None)):
            try:
                out = bits.view(native)
            except _CANNOT:
                pass
            else:
                if self._dtype(out) is dtype:
                    return out
        wide = self.xp.asarray(host.astype(np.float32), device=dev, copy=True)
        return self.xp.astype(wide, native)


class ArrayApiAdapter:
    """The `trainrec.Adapter` of an `ArrayApiBackend`: it claims the library's arrays, its
    array type and its device objects, returning the backend for each. An adapter that
    also binds models or optimizers subclasses it and adds those to `adapt`."""

    def __init__(self, backend: ArrayApiBackend) -> None:
        self.backend = backend

    @property
    def name(self) -> str:
        return self.backend.name

    def adapt(self, obj: Any) -> Any:
        b = self.backend
        if b.is_tensor(obj) or b.is_tensor_type(obj) or b.is_device(obj):
            return b
        return None


def _namespace(xp: Any) -> ModuleType:
    if isinstance(xp, ModuleType):
        if not callable(getattr(xp, "asarray", None)):
            raise TypeError(f"{xp.__name__} is not an array namespace (it has no asarray)")
        xp = xp.asarray(0)
    try:
        ns: ModuleType = array_api_compat.array_namespace(xp)
    except TypeError as e:
        raise TypeError(f"{type(xp).__qualname__} is not an array of an array-API library: {e}") from e
    return ns


def _library_name(xp: ModuleType) -> str:
    """`array_api_compat.numpy` -> "numpy", `jax.numpy` -> "jax", `array_api_strict` -> itself."""
    name = xp.__name__
    if name.startswith("array_api_compat."):
        return name.split(".")[1]
    return name.partition(".")[0]


def _same(a: Any, b: Any) -> bool:
    """Equal devices of the same type (torch compares its devices with strings as False;
    others might raise)."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a device that cannot be compared is not this one
        return False


def _key(dev: Device) -> Any:
    try:
        hash(dev)
    except TypeError:
        return repr(dev)
    return dev


def _on_cpu(tensor: Tensor) -> bool:
    try:
        return int(tensor.__dlpack_device__()[0]) == _CPU
    except (*_CANNOT, OverflowError):
        return True  # no DLPack: let the readers try


def _first(*attempts: Any, what: str) -> Any:
    """The result of the first attempt that does not raise one of `_CANNOT`; a `TypeError`
    listing every failure when none succeeds."""
    failures = []
    for attempt in attempts:
        try:
            return attempt()
        except _CANNOT as e:
            failures.append(f"{type(e).__name__}: {e}")
    raise TypeError(f"{what} ({'; '.join(failures)})")
