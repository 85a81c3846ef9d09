// Version of the Ostinato native additions, checked by the ctypes bindings at load.
extern "C" {
const char * ostinato_native_version(void) { return "0.1.0"; }
}
