"""``comfy.latent_formats``: the VAE latent's scale and shift per family (``process_in`` before the
model, ``process_out`` after)."""


class LatentFormat:
    scale_factor = 1.0
    shift_factor = 0.0
    latent_channels = 4

    def process_in(self, latent):
        return (latent - self.shift_factor) * self.scale_factor

    def process_out(self, latent):
        return latent / self.scale_factor + self.shift_factor


class SD15(LatentFormat):
    scale_factor = 0.18215


class SD3(LatentFormat):
    latent_channels = 16
    scale_factor = 1.5305
    shift_factor = 0.0609


class Flux(SD3):
    scale_factor = 0.3611
    shift_factor = 0.1159
